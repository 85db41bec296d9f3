"""Benchmark + check of the fused MoE router (pallas_kernels/router.py) at Flash's shapes on one GPU.

  PYTHONUNBUFFERED=1 PYTHONPATH=. timeout 150 python3 scripts/bench_router.py --out $OUT

For T in (64, 1, 8, 512, 4096) (decode first), D=5120, E=384, k=6:
  1. correctness of route_pallas vs route_reference (f32 HIGHEST): ids identical except near-ties (the
     reference's top-7 keys closer than --tie-gap), weights within rtol 2e-5 / atol 1e-6, order and
     group sizes identical where ids are; also the XLA path vs the reference.
  2. GPU time (CUPTI, all kernels of one call summed; median of --iters calls, each after a 256 MiB write
     that flushes the 50 MB L2 so the 3.9 MB gate weight comes from HBM as in the model) of:
     pallas (whole route_fused: GEMM + split sum + selection + permutation), the XLA path (moe.route +
     argsort + bincount: today's code), the split-K GEMM + sum alone, the selection kernel alone, the two
     permutation methods alone, and PyTorch's router on the same data (scripts/torch_baselines.py, CUDA events,
     checked like the others).
  3. roofline = max((weight + x bytes) / HBM bandwidth, FLOPs / matmul rate), both measured in this run
     (torch f32 sum over 1 GiB, torch bf16 8192^3 matmul; XLA fallbacks).
Prints one table and writes results.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

T0 = time.time()
D, E, K = 5120, 384, 6


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------------------------------
# timing

def time_gpu(f, args, iters, flush):
    """Median GPU ms per call, L2 flushed before each call: bench_sparse_attention.time_gpu (CUPTI, the sum over
    the call's kernels; wall clock, which then includes the dispatch, if CUPTI is unavailable)."""
    import bench_sparse_attention as bsa

    tot, _, names = bsa.time_gpu(f, args, iters=iters, cold=True, flush=flush)
    return tot, "wall" if names == ["wall-clock"] else "cupti"


def ceilings():
    """HBM read bandwidth and bf16 matmul rate measured here (bench_expert_gemm's: PyTorch and XLA, the best)."""
    import bench_expert_gemm

    return bench_expert_gemm.ceilings(quick=False)


# ---------------------------------------------------------------------------------------------------
# checks


def check(name, out, ref, x, w, bias, tie_gap):
    """-> dict with PASS/FAIL and error numbers (see the module doc)."""
    wts, ids, order, sizes = (np.asarray(a) for a in out)
    rw, rids, rorder, rsizes = (np.asarray(a) for a in ref)
    from pallas_kernels.router import scores_reference

    keys = np.asarray(scores_reference(x, w)) + np.asarray(bias)[None]
    top = -np.sort(-keys, axis=1)[:, :K + 1]
    near = (np.diff(-top, axis=1) < tie_gap).any(axis=1)  # a near-tie among the top-7 keys
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


def torch_route(x, gate, rc, ref, tie_gap, iters):
    """PyTorch's router on the same data (scripts/torch_baselines.py: float32 logits, torch.topk), shared with
    JAX through DLPack -> (check dict, us per call with L2 flushed)."""
    import torch
    import torch_baselines as tb

    xt, bt = (torch.from_dlpack(jax.block_until_ready(a)) for a in (x, gate["bias"]))
    w32 = torch.from_dlpack(jax.block_until_ready(gate["weight"])).float()  # converted once, outside the timing
    fn = lambda: tb.route(xt, w32, bt, rc.k, rc.route_scale, rc.gate_temp)  # noqa: E731
    res = check("torch", [a.cpu().numpy() for a in fn()], ref, x, gate["weight"], gate["bias"], tie_gap)
    us = tb.cuda_time_us(fn, iters=iters, flush=tb.l2_flusher())
    del xt, bt, w32
    torch.cuda.empty_cache()
    return res, us


# ---------------------------------------------------------------------------------------------------


def main():
    global D, E
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="64,1,8,512,2048,4096")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tie-gap", type=float, default=1e-5)
    ap.add_argument("--budget-s", type=float, default=160.0, help="skip the remaining cases after this")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test: Mosaic GPU interpreter, small D/E")
    ap.add_argument("--d", type=int, default=D)
    ap.add_argument("--e", type=int, default=E)
    args = ap.parse_args()
    D, E = args.d, args.e
    os.makedirs(args.out, exist_ok=True)

    from dsv41.config import ModelConfig
    from pallas_kernels import router as R

    log("devices", jax.devices())
    import dataclasses

    cfg = dataclasses.replace(ModelConfig(), n_routed_experts=E)
    assert cfg.n_activated_experts == K, cfg.n_activated_experts
    backend = "interpret" if args.interpret else "pallas"
    rc = R.RouteConfig.of(cfg)
    results = {"ceilings": {}, "cases": [], "errors": []}
    try:
        results["ceilings"] = ceil = ceilings() if not args.interpret else {"hbm_TBps": 4.3, "mm_TFLOPs": 660.0}
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        ceil = results["ceilings"] = {"hbm_TBps": 4.3, "mm_TFLOPs": 660.0, "ceilings_assumed": True}
    log("ceilings", ceil)

    flush_buf = jnp.zeros(((256 << 20) if not args.interpret else 4096) // 4, jnp.float32)
    flush = jax.jit(lambda b: b + 1.0)

    def do_flush():
        return flush(flush_buf)

    key = jax.random.key(0)
    kw, kb = jax.random.split(key)
    w = (jax.random.normal(kw, (E, D), jnp.float32) * 0.02).astype(jnp.bfloat16)  # logits ~ N(0, ~1.4^2)
    bias = jax.random.normal(kb, (E,), jnp.float32) * 0.1
    gate = {"weight": w, "bias": bias, "bias_vl": bias}

    def save():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)

    for t in [int(v) for v in args.tokens.split(",")]:
        if time.time() - T0 > args.budget_s:
            log(f"budget reached, skipping T={t}")
            results["errors"].append(f"skipped T={t} (budget)")
            continue
        x = jax.random.normal(jax.random.fold_in(key, t), (t, D), jnp.float32).astype(jnp.bfloat16)
        case = {"T": t, "config": repr(R.default_config(t, D, E)), "timings": {}, "checks": []}
        results["cases"].append(case)
        byts = E * D * 2 + t * D * 2
        flops = 2 * t * D * E
        roof_ms = max(byts / (ceil["hbm_TBps"] * 1e12), flops / (ceil["mm_TFLOPs"] * 1e12)) * 1e3
        case.update(bytes=byts, flops=flops, roofline_ms=roof_ms)
        fns = {
            "pallas": jax.jit(lambda x, g: R.route_fused(x, g, cfg, backend=backend)),
            "xla": jax.jit(lambda x, g: R.route_fused(x, g, cfg, backend="xla")),
        }
        try:
            ref = jax.jit(lambda x, g: R.route_reference(x, g, rc))(x, gate)
            jax.block_until_ready(ref)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            results["errors"].append(f"T={t} reference: {traceback.format_exc()[-500:]}")
            ref = None
        for name in ("pallas", "xla"):
            if ref is None:
                break
            try:
                t1 = time.time()
                out = fns[name](x, gate)
                jax.block_until_ready(out)
                log(f"T={t} {name}: compile+run {time.time() - t1:.1f}s")
                case["checks"].append(check(name, out, ref, x, w, bias, args.tie_gap))
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                case["checks"].append({"path": name, "ok": False, "error": traceback.format_exc()[-800:]})
        if ref is not None:
            ids = ref[1]
            fns["perm_count"] = jax.jit(lambda i: R.permutation(i, E, "count")) if t * K <= 4096 else None
            fns["perm_argsort"] = jax.jit(lambda i: R.permutation(i, E, "argsort"))
        # The split-K GEMM + XLA sum alone, for the default
        # config and, at decode sizes, a few (splits, warpgroups) variants: tuning data for default_config.
        dflt = R.default_config(t, D, E)
        variants = [dflt]
        if t <= 64 and not args.interpret:
            import dataclasses as dc

            variants += [dc.replace(dflt, splits=sv, num_wgs=nv) for sv, nv in ((10, 1), (20, 1), (40, 1), (20, 2))
                         if (sv, nv) != (dflt.splits, dflt.num_wgs)]
        for v in variants:
            def gate_sum(x, g, v=v, t=t):
                parts = R._gate_kernel(R._round_up(t, v.tm), D, E, v, args.interpret)(x, g["weight"])
                return jnp.sum(parts, axis=0).T
            fns[f"gemm+sum S{v.splits} wg{v.num_wgs}" + (" (default)" if v == dflt else "")] = jax.jit(gate_sum)
        # The selection kernel alone on logits of the model's scale.
        r_, tb_ = R.select_tiling(E, K)
        t_sel = R._round_up(t, tb_)
        sel_args = (jax.random.normal(jax.random.fold_in(kb, t), (t_sel * r_, 64), jnp.float32) * 1.4,
                    bias.reshape(r_, 64))
        fns["select alone"] = jax.jit(lambda lg, b, t_sel=t_sel: R._select_kernel(t_sel, E, rc, args.interpret)(lg, b))
        for name, fn in fns.items():
            if fn is None or time.time() - T0 > args.budget_s + 10:
                continue
            try:
                a = (ids,) if name.startswith("perm") else sel_args if name == "select alone" else (x, gate)
                if name.startswith("gemm") and time.time() - T0 > args.budget_s:
                    continue
                ms, how = time_gpu(fn, a, args.iters, do_flush)
                case["timings"][name] = {"us": ms * 1e3, "how": how}
                log(f"T={t} {name}: {ms * 1e3:.2f} us ({how})")
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                case["timings"][name] = {"error": traceback.format_exc()[-800:]}
        if ref is not None and not args.interpret and time.time() - T0 <= args.budget_s + 10:
            try:
                res, us = torch_route(x, gate, rc, ref, args.tie_gap, args.iters)
                case["checks"].append(res)
                case["timings"]["torch"] = {"us": us, "how": "cuda events"}
                log(f"T={t} torch: {us:.2f} us")
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                case["timings"]["torch"] = {"error": traceback.format_exc()[-800:]}
        save()

    # ---- the table
    print(f"\nFused MoE router, D={D} E={E} k={K}; GPU us per call (L2 flushed), roofline = "
          f"max(bytes / {ceil['hbm_TBps']:.2f} TB/s, FLOPs / {ceil['mm_TFLOPs']:.0f} TFLOP/s)")
    hdr = ("T", "check pallas", "check xla", "pallas", "xla", "roofline", "xla/pallas",
           "pallas/roof", "perm count", "perm argsort", "check torch", "torch")
    print(" | ".join(f"{h:>14}" for h in hdr))
    for c in results["cases"]:
        tm = {k: v.get("us") for k, v in c["timings"].items()}
        ck = {d["path"]: d for d in c["checks"]}

        def cs(p, ck=ck):
            d = ck.get(p)
            if d is None:
                return "-"
            if "error" in d:
                return "ERROR"
            return ("PASS" if d["ok"] else "FAIL") + f" {d['max_abs_w_err']:.1e}/{d['hard_mismatch_rows']}h{d['near_tie_rows']}n"

        def f(v):
            return "-" if v is None else f"{v:.2f}"

        p, xl, roof = tm.get("pallas"), tm.get("xla"), c["roofline_ms"] * 1e3
        print(" | ".join(f"{v:>14}" for v in (
            c["T"], cs("pallas"), cs("xla"), f(p), f(xl), f(roof),
            f(xl / p) if p and xl else "-", f(p / roof) if p else "-", f(tm.get("perm_count")),
            f(tm.get("perm_argsort")), cs("torch"), f(tm.get("torch")))))
    print("check = PASS|FAIL max|w err| / hard id mismatches 'h' / rows with a near-tie in the top-7 'n'")
    print("\nsplit-K gate GEMM + XLA split sum alone, and the selection kernel alone (us)")
    for c in results["cases"]:
        parts = [f"{k[9:]}: {v['us']:.2f}" for k, v in c["timings"].items() if k.startswith("gemm+sum") and "us" in v]
        sel = c["timings"].get("select alone", {}).get("us")
        print(f"  T={c['T']}: " + "; ".join(parts) + ("" if sel is None else f" | select {sel:.2f}"))
    save()
    log("wrote", os.path.join(args.out, "results.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
