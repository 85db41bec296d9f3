"""Check and time the fused MoE router (pallas_kernels/router.py) at Flash's shapes (D 5120, E 384, top-6).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/bench_router.py --out $OUT [--tokens 64,1,8,512,2048,4096]

Checks route_fused (pallas and XLA) and PyTorch's router (scripts/torch_baselines.py) against route_reference (f32
HIGHEST): ids identical except near-ties (top-7 keys closer than TIE_GAP), weights within rtol 2e-5 / atol 1e-6,
order and group sizes where ids agree. Times each (CUPTI, L2 flushed so the 3.9 MB gate weight comes from HBM;
PyTorch by CUDA events). Roofline = max(bytes / HBM, FLOPs / matmul rate), both measured in this run.
"""

from __future__ import annotations

import sys
import time

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

from dsv41.config import ModelConfig
from pallas_kernels import router as R
from timing import fmt, log

D, E, K = 5120, 384, 6
TIE_GAP = 1e-5


def check(name, out, ref, x, w, bias):
    """-> dict with PASS/FAIL and error numbers (see the module doc)."""
    wts, ids, order, sizes = (np.asarray(a) for a in out)
    rw, rids, rorder, rsizes = (np.asarray(a) for a in ref)
    keys = np.asarray(R.scores_reference(x, w)) + np.asarray(bias)[None]
    top = -np.sort(-keys, axis=1)[:, :K + 1]
    near = (np.diff(-top, axis=1) < TIE_GAP).any(axis=1)  # a near-tie among the top-7 keys
    bad_rows = (ids != rids).any(axis=1)
    hard = bad_rows & ~near
    same = ~bad_rows
    werr = float(np.abs(wts[same] - rw[same]).max()) if same.any() else 0.0
    wok = bool(np.allclose(wts[same], rw[same], rtol=2e-5, atol=1e-6))
    perm_ok = bool((order == rorder).all() and (sizes == rsizes).all()) if not bad_rows.any() else \
        bool(sizes.sum() == rsizes.sum())
    ok = (not hard.any()) and wok and perm_ok
    r = {"path": name, "ok": ok, "rows": int(ids.shape[0]), "id_mismatch_rows": int(bad_rows.sum()),
         "near_tie_rows": int(near.sum()), "hard_mismatch_rows": int(hard.sum()), "max_abs_w_err": werr,
         "perm_ok": perm_ok}
    log(f"check {name}: {'PASS' if ok else 'FAIL'} {r}")
    return r


def torch_route(x, gate, rc, ref, iters):
    """PyTorch's router on the same data (scripts/torch_baselines.py: float32 logits, torch.topk), shared with
    JAX through DLPack -> (check dict, us per call with L2 flushed)."""
    import torch
    import torch_baselines as tb

    xt, bt = (torch.from_dlpack(jax.block_until_ready(a)) for a in (x, gate["bias"]))
    w32 = torch.from_dlpack(jax.block_until_ready(gate["weight"])).float()  # converted once, outside the timing
    fn = lambda: tb.route(xt, w32, bt, rc.k, rc.route_scale, rc.gate_temp)  # noqa: E731
    res = check("torch", [a.cpu().numpy() for a in fn()], ref, x, gate["weight"], gate["bias"])
    us = timing.cuda_time_us(fn, iters=iters, flush=timing.l2_flusher())
    del xt, bt, w32
    torch.cuda.empty_cache()
    return res, us


def main():
    ap = timing.bench_args(__doc__, out=".", iters=10, budget_s=160.0)
    ap.add_argument("--tokens", default="64,1,8,512,2048,4096")
    args = ap.parse_args()
    cfg = ModelConfig()
    assert (cfg.dim, cfg.n_routed_experts, cfg.n_activated_experts) == (D, E, K)
    rc = R.RouteConfig.of(cfg)
    ceil = timing.bench_ceilings()
    results = {"ceilings": ceil, "cases": [], "errors": []}
    do_flush = timing.jax_flusher()

    key = jax.random.key(0)
    kw, kb = jax.random.split(key)
    w = (jax.random.normal(kw, (E, D), jnp.float32) * 0.02).astype(jnp.bfloat16)  # logits ~ N(0, ~1.4^2)
    bias = jax.random.normal(kb, (E,), jnp.float32) * 0.1
    gate = {"weight": w, "bias": bias, "bias_vl": bias}

    for t in [int(v) for v in args.tokens.split(",")]:
        if timing.over_budget(args.budget_s, f"T={t}"):
            results["errors"].append(f"skipped T={t} (budget)")
            continue
        x = jax.random.normal(jax.random.fold_in(key, t), (t, D), jnp.float32).astype(jnp.bfloat16)
        byts, flops = E * D * 2 + t * D * 2, 2 * t * D * E
        roof_ms = max(byts / (ceil["hbm_TBps"] * 1e12), flops / (ceil["mm_TFLOPs"] * 1e12)) * 1e3
        case = {"T": t, "config": repr(R.default_config(t, D, E)), "timings": {}, "checks": [], "bytes": byts,
                "flops": flops, "roofline_ms": roof_ms}
        results["cases"].append(case)
        fns = {"pallas": jax.jit(lambda x, g: R.route_fused(x, g, cfg, backend="pallas")),
               "xla": jax.jit(lambda x, g: R.route_fused(x, g, cfg, backend="xla"))}
        try:
            ref = jax.block_until_ready(jax.jit(lambda x, g: R.route_reference(x, g, rc))(x, gate))
        except Exception as ex:  # noqa: BLE001
            results["errors"].append(f"T={t} reference: {timing.failure(f'T={t} reference', ex)}")
            ref = None
        for name in ("pallas", "xla") if ref is not None else ():
            try:
                t1 = time.time()
                out = jax.block_until_ready(fns[name](x, gate))
                log(f"T={t} {name}: compile+run {time.time() - t1:.1f}s")
                case["checks"].append(check(name, out, ref, x, w, bias))
            except Exception as ex:  # noqa: BLE001
                case["checks"].append({"path": name, "ok": False, "error": timing.failure(f"T={t} {name}", ex)})
        late = timing.elapsed_s() > args.budget_s + 10  # past the budget mid-case: the timings are skipped
        for name, fn in fns.items() if not late else ():
            with timing.guarded(f"T={t} {name} timing", case["timings"].setdefault(name, {})) as tm:
                ms, _, names = timing.time_gpu(fn, (x, gate), iters=args.iters, flush=do_flush)
                tm.update(us=ms * 1e3, how=timing.how(names))
                log(f"T={t} {name}: {ms * 1e3:.2f} us ({timing.how(names)})")
        if ref is not None and not late:
            with timing.guarded(f"T={t} torch", case["timings"].setdefault("torch", {})) as tm:
                res, us = torch_route(x, gate, rc, ref, args.iters)
                case["checks"].append(res)
                tm.update(us=us, how="cuda events")
                log(f"T={t} torch: {us:.2f} us")
        timing.write_json(args.out, "results.json", results)

    print(f"\nFused MoE router, D={D} E={E} k={K}; GPU us per call (L2 flushed), roofline = "
          f"max(bytes / {ceil['hbm_TBps']:.2f} TB/s, FLOPs / {ceil['mm_TFLOPs']:.0f} TFLOP/s)")
    rows = []
    for c in results["cases"]:
        tm = {k: v.get("us") for k, v in c["timings"].items()}
        ck = {d["path"]: d for d in c["checks"]}

        def cs(p, ck=ck):
            d = ck.get(p)
            if d is None or "error" in d:
                return "-" if d is None else "ERROR"
            return (("PASS" if d["ok"] else "FAIL")
                    + f" {d['max_abs_w_err']:.1e}/{d['hard_mismatch_rows']}h{d['near_tie_rows']}n")

        p, xl, roof = tm.get("pallas"), tm.get("xla"), c["roofline_ms"] * 1e3
        rows.append([c["T"], cs("pallas"), cs("xla"), fmt(p), fmt(xl), fmt(roof), fmt(xl / p if p and xl else None),
                     fmt(p / roof if p else None), cs("torch"), fmt(tm.get("torch"))])
    timing.print_table(["T", "check pallas", "check xla", "pallas", "xla", "roofline", "xla/pallas", "pallas/roof",
                        "check torch", "torch"], rows, "r" * 10)
    print("check = PASS|FAIL max|w err| / hard id mismatches 'h' / rows with a near-tie in the top-7 'n'")
    timing.write_json(args.out, "results.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
