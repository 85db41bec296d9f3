#!/usr/bin/env python3
"""Check and time the FP4 grouped expert GEMM (pallas_kernels/expert_gemm.py) at Flash shapes (384 experts, top-6;
w13 = w1 and w3 as one [4608, 5120] weight, w2 [5120, 2304]).

    PYTHONPATH=. python3 scripts/bench_expert_gemm.py [--decode-tokens 1,8,64] [--prefill-tokens 8192]

Each config is checked on random data against a float32 reference (rel. Frobenius error <= 5e-3, finite), then
timed by CUPTI (median of 5, rotating over routings so the experts are not re-read from L2): the call, the kernel
alone, XLA's dequantize + ragged_dot and ragged_dot on bf16 weights (decode), PyTorch's `torch._grouped_mm` on bf16
weights (CUDA events, L2 flushed); TB/s on the FP4 bytes touched and TFLOP/s as % of this run's ceilings.
"""

from __future__ import annotations

import functools
import re
import statistics

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

from dsv41.quant import Fp4Weight
from pallas_kernels import expert_gemm as eg
from timing import log

ROWS: list[dict] = []


def label(cfg):
    if cfg is None:
        return ""
    return (f"tm{cfg.tm} tk{cfg.tk} wg{cfg.num_wgs} st{cfg.stages}" + (" chain" if cfg.chain else "")
            + (f" ks{cfg.ksplit}" if cfg.ksplit > 1 else "") + (" overlap" if cfg.overlap else "")
            + (f" mma.sync x{cfg.warp_mma}" if cfg.warp_mma else ""))


def parse_configs(spec):
    """'TMxTKxSTAGES[c][o][mM][wW][kK],...' -> [KernelConfig], or None. c: chained, o: decode and multiply in
    two K halves (overlap), mM: warp-level mma.sync into M accumulators (warp_mma), wW: W compute warpgroups
    (default 2), kK: K slices (ksplit). A config that does not fit a weight's N or K is skipped for it."""
    out = []
    for item in filter(None, spec.split(",")):
        tm, tk, st = item.split("x")
        m = re.fullmatch(r"(\d+)([co]*)(?:m(\d))?(?:w(\d))?(?:k(\d+))?", st)
        if m is None:
            raise SystemExit(f"config {item!r}: expected TMxTKxSTAGES[c][o][mM][wW][kK], e.g. 8x256x4cm4, "
                             "64x256x4co or 8x128x4cok5")
        out.append(eg.KernelConfig(tm=int(tm), tk=int(tk), num_wgs=int(m.group(4) or 2), stages=int(m.group(1)),
                                   chain="c" in m.group(2), overlap="o" in m.group(2),
                                   warp_mma=int(m.group(3) or 0), ksplit=int(m.group(5) or 1)))
    return out or None


def make_weight(key, e, n, k):
    k1, k2 = jax.random.split(key)
    return Fp4Weight(jax.random.bits(k1, (e, n, k // 2), jnp.uint8),
                     jax.random.randint(k2, (e, n, k // 32), 117, 125).astype(jnp.uint8))


def make_routings(key, tokens, e, topk, r, k):
    """r routings: (x [M, K] bf16 sorted by expert, group_sizes [E], experts used)."""
    out = []
    for i in range(r):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        idx = jnp.argsort(-jax.random.uniform(k1, (tokens, e)), axis=-1)[:, :topk].reshape(-1)
        gs = jnp.bincount(idx, length=e).astype(jnp.int32)
        out.append((jax.random.normal(k2, (tokens * topk, k), jnp.bfloat16), gs, int(jnp.sum(gs > 0))))
    return out


def check(name, y, ref):
    y, ref = np.asarray(jnp.asarray(y, jnp.float32)), np.asarray(ref)
    finite = bool(np.isfinite(y).all())
    rel = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))
    log(f"check {name}: rel_fro={rel:.2e} finite={finite} -> {'PASS' if finite and rel <= 5e-3 else 'FAIL'}")
    return finite and rel <= 5e-3, rel


def kernel_only(x, pw, gs, cfg):
    """The kernel alone: (jitted call, its schedule args, x's row gather)."""
    m, e, n = x.shape[0], pw.weight.shape[0], pw.weight.shape[1]
    t_max = eg.max_tiles(m, e, cfg.tm)
    te, tr, src, _, _ = eg.tile_schedule(gs, m, cfg.tm, t_max)
    kern = eg._build_kernel(eg.padded_rows(m, e), x.shape[1], n, e, t_max, cfg, False,
                            out_dtype=jnp.float32 if cfg.ksplit > 1 else jnp.bfloat16)
    return jax.jit(kern), (eg.pack_schedule(te, tr),), src


def padded_reference(x, gs, wbf16):
    """A batched dot over the groups padded to the largest, float32 accumulation (XLA lowers ragged_dot at prefill
    size to a dense masked dot of 180-360 GiB)."""
    g = np.asarray(gs)
    mg = max(int(g.max()), 1)
    idx = (np.cumsum(g) - g)[:, None] + np.arange(mg)[None]
    val = np.arange(mg)[None] < g[:, None]
    yg = jax.jit(lambda a, b: jnp.einsum("egk,enk->egn", a, b, preferred_element_type=jnp.float32,
                                         precision=jax.lax.Precision.HIGHEST))(x[jnp.asarray(np.where(val, idx, 0))],
                                                                               wbf16)
    return np.asarray(jnp.zeros((x.shape[0], wbf16.shape[1]), jnp.float32).at[jnp.asarray(idx[val])].set(
        yg[jnp.asarray(val)]))


def run_case(kind, mat, tokens, n, k, e, w, pw, wbf16, configs, args):
    topk = 6
    routs = make_routings(jax.random.key(hash((mat, tokens)) % 2**31), tokens, e, topk,
                          1 if kind == "prefill" else args.rot, k)
    m = tokens * topk
    x0, gs0, _ = routs[0]
    fp4_bytes = statistics.mean(u for _, _, u in routs) * n * (k // 2 + k // 32) + m * k * 2 + m * n * 2
    ref = padded_reference(x0, gs0, wbf16)
    sets = [(x, gs) for x, gs, _ in routs]

    def add(path, cfg, t_cupti, t_wall, ok=None, rel=None):
        t = t_cupti if t_cupti is not None else t_wall
        ROWS.append({"case": f"{kind} {mat} T={tokens}", "path": path, "cfg": label(cfg), "us": t * 1e6,
                     "wall_us": t_wall * 1e6, "TBps": fp4_bytes / t / 1e12, "TFLOPs": 2 * m * n * k / t / 1e12,
                     "ok": ok, "rel": rel})
        log(f"{kind} {mat} T={tokens} {path} [{label(cfg)}]: {t * 1e6:.1f} us")

    def guarded(name, body):
        if timing.over_budget(args.budget_s, f"{kind} {mat} T={tokens} {name}"):
            return
        try:
            body()
        except Exception as ex:  # noqa: BLE001
            timing.failure(f"{name} {kind} {mat}", ex)
            ROWS.append({"case": f"{kind} {mat} T={tokens}", "path": name, "cfg": "", "ok": False})

    for cfg in configs:
        if k % cfg.tk or n % cfg.tn or (k // cfg.tk) % cfg.ksplit:
            log(f"skip {kind} {mat} [{label(cfg)}]: does not fit N={n}, K={k}")
            continue

        def pallas(cfg=cfg):
            f = jax.jit(functools.partial(eg.grouped_fp4_matmul, backend="pallas", config=cfg))
            ok, rel = check(f"{kind} {mat} T={tokens} {label(cfg)}", f(x0, pw, gs0), ref)
            add("pallas", cfg, *timing.time_calls(f, [(x, pw, g) for x, g in sets]), ok, rel)
            kf, ksets = kernel_only(x0, pw, gs0, cfg)[0], []
            for x, gs in sets:  # x already in the kernel's padded row layout
                _, sched, src = kernel_only(x, pw, gs, cfg)
                ksets.append((*sched, jnp.take(x, src, axis=0, mode="fill", fill_value=0), pw.weight, pw.scale_t))
            add("pallas-kernel", cfg, *timing.time_calls(kf, ksets), ok, rel)
        guarded("pallas", pallas)

    def torch_mm():
        import torch
        import torch_baselines as tb

        xt, wt, gt = (torch.from_dlpack(jax.block_until_ready(a)) for a in (x0, wbf16, gs0))
        ok, rel = check("torch _grouped_mm", tb.grouped_mm(xt, wt, gt).float().cpu().numpy(), ref)
        us = timing.cuda_time_us(lambda: tb.grouped_mm(xt, wt, gt), iters=10, flush=timing.l2_flusher())
        add("torch _grouped_mm(bf16 w)", None, None, us * 1e-6, ok, rel)
        del xt, wt, gt
        torch.cuda.empty_cache()

    def xla():
        fx = jax.jit(functools.partial(eg.grouped_fp4_matmul, backend="xla"))
        ok, rel = check(f"{kind} {mat} T={tokens} xla", fx(x0, w, gs0), ref)
        add("xla dequant+ragged_dot", None, *timing.time_calls(fx, [(x, w, g) for x, g in sets[:2]], reps=3), ok, rel)
        fr = jax.jit(lambda x, wb, g: jax.lax.ragged_dot(x, wb, g, preferred_element_type=jnp.float32
                                                         ).astype(jnp.bfloat16))
        wkn = jnp.swapaxes(wbf16, 1, 2)
        add("xla ragged_dot(bf16 w)", None, *timing.time_calls(fr, [(x, wkn, g) for x, g in sets], reps=3))

    if not args.no_torch:
        guarded("torch", torch_mm)
    if not args.skip_baselines and kind == "decode":  # XLA's ragged_dot runs out of memory at prefill sizes
        guarded("xla", xla)


def dump(ceil, args):
    print(f"\nceilings measured in this run: {timing.ceiling_line(ceil)}")
    rows = []
    for r in ROWS:
        if "us" not in r:
            rows.append([r["case"], r["path"], r["cfg"], "FAILED", "", "", "", "", ""])
            continue
        chk = "" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL") + f" {r['rel']:.1e}"
        rows.append([r["case"], r["path"], r["cfg"], f"{r['us']:.1f}", f"{r['TBps']:.2f}",
                     f"{100 * r['TBps'] / ceil['hbm_TBps']:.0f}", f"{r['TFLOPs']:.1f}",
                     f"{100 * r['TFLOPs'] / ceil['mm_TFLOPs']:.0f}", chk])
    timing.print_table(["case", "path", "config", "us", "TB/s", "% HBM", "TFLOP/s", "% mm", "check"], rows,
                       "lll" + "r" * 5 + "l")
    timing.write_json(args.out, "bench_expert_gemm.json", {"ceilings": ceil, "rows": ROWS,
                                                            "device": str(jax.devices())})


def main():
    ap = timing.bench_args(__doc__, budget_s=330)
    ap.add_argument("--rot", type=int, default=6, help="routings rotated through when timing decode")
    ap.add_argument("--decode-tokens", default="1,8,64")
    ap.add_argument("--prefill-tokens", default="8192", help="e.g. 2048,8192")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-baselines", action="store_true", help="no XLA rows")
    ap.add_argument("--no-torch", action="store_true", help="no PyTorch row")
    ap.add_argument("--decode-configs", default="",
                    help="configs instead of default_config's, " + parse_configs.__doc__)
    ap.add_argument("--prefill-configs", default="", help="as --decode-configs, for the prefill cases")
    args = ap.parse_args()
    ceil = timing.bench_ceilings()
    e, shapes = 384, {"w13": (4608, 5120), "w2": (5120, 2304)}
    weights = {}
    for i, (mat, (n, k)) in enumerate(shapes.items()):
        w = make_weight(jax.random.key(10 + i), e, n, k)
        wbf16 = jnp.concatenate([jax.jit(  # a few experts at a time (float32 inside)
            lambda q, sc: Fp4Weight(q, sc).dequantize(jnp.bfloat16))(w.weight[j:j + 32], w.scale[j:j + 32])
            for j in range(0, e, 32)])
        weights[mat] = jax.block_until_ready((n, k, w, eg.prepare_fp4_experts(w), wbf16))
    dec_cfgs, pre_cfgs = parse_configs(args.decode_configs), parse_configs(args.prefill_configs)
    try:
        dec = sorted(int(t) for t in args.decode_tokens.split(",") if t)
        pre = [] if args.skip_prefill else [int(t) for t in args.prefill_tokens.split(",") if t]
        # priority order (the budget cuts the tail): the largest decode, prefill, the other decodes
        for kind, tokens in [("decode", dec[-1])] + [("prefill", t) for t in pre] + [("decode", t) for t in dec[:-1]]:
            for mat, (n, k, w, pw, wbf16) in weights.items():
                cfgs = (dec_cfgs if kind == "decode" else pre_cfgs) or [eg.default_config(tokens * 6, n, k, e)]
                run_case(kind, mat, tokens, n, k, e, w, pw, wbf16, cfgs, args)
    except KeyboardInterrupt:  # `timeout -s INT`: keep what was measured
        log("interrupted")
    dump(ceil, args)


if __name__ == "__main__":
    main()
