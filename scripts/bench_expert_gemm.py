#!/usr/bin/env python3
"""Check and time the FP4 grouped expert GEMM (pallas_kernels/expert_gemm.py) at Flash shapes.

On the H200 (device tool):  PYTHONPATH=. PYTHONUNBUFFERED=1 python3 scripts/bench_expert_gemm.py --out $OUT
On a CPU (logic only, tiny shapes, interpreter): .venv/bin/python scripts/bench_expert_gemm.py --cpu-smoke

What it does, in one process:
1. ceilings measured in the same run: HBM read bandwidth (PyTorch f32 sum over 2 GiB, CUDA events; JAX f32
   sum as a fallback) and the bf16 matmul rate (8192^3, PyTorch and XLA, the best of the two);
2. checks every Pallas variant on fresh random data (random packed bytes: every e2m1 code; scale bytes
   117..124) against `expert_gemm_reference` (float32 weights, float32 HIGHEST ragged_dot) for decode, and
   for prefill against a batched dot over groups padded to the largest with exact bf16 weights and float32
   accumulation (XLA lowers ragged_dot at M=49152 to a dense masked dot that needs 180-360 GiB): pass =
   relative Frobenius error <= 5e-3 and every output finite (bf16 output rounding alone gives ~1.7e-3);
3. times (median over 5 repeats, rotating over several routings so repeated calls do not re-read the same
   experts from L2) the GPU time of every kernel of a call by CUPTI (what the table shows; --no-cupti: none),
   and the pipelined wall clock per call (in the JSON; at 1 token it is JAX's dispatch rate). Every timed
   function gets its arrays as arguments: profiler.measure jits what it times, and arrays a closure holds
   become constants of that program (multi-GB weights: the process died, 2026-11-30):
   - pallas: the whole `grouped_fp4_matmul(backend='pallas')` (schedule + kernel + row gather) and the
     kernel alone;
   - xla: `grouped_fp4_matmul(backend='xla')` (dequantize all experts + lax.ragged_dot), and
     lax.ragged_dot alone on pre-dequantized bf16 weights;
   - mgpu: jax's ragged_dot_mgpu on pre-dequantized bf16 weights (prefill and decode B=64 only);
   - torch: PyTorch's torch._grouped_mm on the same bf16 weights (scripts/torch_baselines.py; CUDA events,
     L2 flushed before each call; --no-torch skips it);
4. prints one table: time, effective bandwidth on the FP4 expert bytes touched (decode) or TFLOP/s
   (prefill), and the percentage of the measured ceiling;
5. `--breakdown`: each kernel of the whole call; `--moe 2048,8192`: a whole MoE layer's routed experts as the
   engine runs them (`dsv41.moe.routed_experts`: the two GEMMs and what runs around them), by kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # torch_baselines
from dsv41.quant import Fp4Weight
from pallas_kernels import expert_gemm as eg

T0 = time.time()
INTERPRET = False  # --tiny: run the whole script logic on CPU through the interpreter
ROWS: list[dict] = []
FAILED: set = set()
LOG: list[str] = []
MOE_ROWS: list[dict] = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(f"[{time.time() - T0:6.1f}s] {s}", flush=True)
    LOG.append(s)


def label(cfg):
    if cfg is None or isinstance(cfg, str):
        return cfg or ""
    return (f"tm{cfg.tm} tk{cfg.tk} wg{cfg.num_wgs} st{cfg.stages}" + (" chain" if cfg.chain else "")
            + (f" ks{cfg.ksplit}" if cfg.ksplit > 1 else "") + (" A-in-smem" if cfg.a_smem else "")
            + (" overlap" if cfg.overlap else "") + (" 2acc" if cfg.two_accs else "")
            + (" NO-DECODE" if cfg.skip_decode else "") + (" stream-K" if cfg.stream else "")
            + (f" mma.sync x{cfg.warp_mma}" if cfg.warp_mma else ""))


def elapsed():
    return time.time() - T0


# ---------------------------------------------------------------------------------------------------
# timing


_CUPTI_OK = None  # None: not tried yet; False after a failure or with --no-cupti


def time_calls(fn, arg_sets, reps=5):
    """Median seconds per call of the jitted fn over `arg_sets` (rotated): (cupti_s or None, wall_s).
    cupti_s: the GPU time of the call's kernels (CUPTI). wall_s: calls queued back to back, so where a call's GPU
    time is below JAX's dispatch cost (decode at 1 token) it is the dispatch rate. Every array fn reads must be
    in its arguments (see the module docstring)."""
    if INTERPRET:
        reps = 1
    global _CUPTI_OK
    out = fn(*arg_sets[0])
    jax.block_until_ready(out)
    for a in arg_sets[1:]:
        jax.block_until_ready(fn(*a))
    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        for a in arg_sets:
            out = fn(*a)
            if INTERPRET:  # the interpreter is not re-entrant: no overlapping calls
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        walls.append((time.perf_counter() - t) / len(arg_sets))
    cupti = None
    if _CUPTI_OK is not False:
        try:
            from jax.experimental.mosaic.gpu import profiler

            measured = profiler.measure(fn)
            vals = []
            for _ in range(reps):
                vals.append(sum(measured(*a)[1] for a in arg_sets) / 1e3 / len(arg_sets))
            cupti = statistics.median(vals)
            _CUPTI_OK = True
        except Exception as ex:  # noqa: BLE001
            if _CUPTI_OK is None:
                log("CUPTI timing unavailable, wall clock only:", type(ex).__name__, str(ex)[:200])
            _CUPTI_OK = False
    return cupti, statistics.median(walls)


def kernel_breakdown(fn, args, reps=5):
    """CUPTI GPU time of the kernels one call of the jitted fn launches -> (median total us, kernels a call,
    [(name, median us summed over the kernels of that name)] largest first). By name, not by position: the
    records of a call do not come in the same order every call (a command buffer's kernels may run
    concurrently; on the H200, 2026-12-01, medians taken position by position paired times with wrong names)."""
    from jax.experimental.mosaic.gpu import profiler

    measured = profiler.measure(fn, aggregate=False)
    runs = [measured(*args)[1] or [] for _ in range(reps)]
    by_name = []
    for r in runs:
        d = {}
        for name, ms in r:
            d[name] = d.get(name, 0.0) + ms * 1e3
        by_name.append(d)
    names = set().union(*by_name)
    parts = sorted(((n, statistics.median(d.get(n, 0.0) for d in by_name)) for n in names), key=lambda p: -p[1])
    return statistics.median(sum(d.values()) for d in by_name), len(runs[0]), parts


def print_breakdown(title, breakdown, top=8):
    total, count, parts = breakdown
    print(f"{title}: {count} kernels, {total:.1f} us")
    for name, us in parts[:top]:
        print(f"    {us:9.1f} us  {name[:90]}")


# ---------------------------------------------------------------------------------------------------
# ceilings


def ceilings(quick: bool):
    import bench_sparse_attention as bsa

    res = {}
    try:
        import torch

        assert torch.cuda.is_available()
        n = (1 << 31) // 4
        x = torch.randn(n, device="cuda", dtype=torch.float32)
        res["hbm_torch_sum_TBps"] = n * 4 / bsa.cuda_event_median_s(x.sum, iters=30) / 1e12
        del x
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        res["mm_torch_TFLOPs"] = 2 * 8192**3 / bsa.cuda_event_median_s(functools.partial(torch.matmul, a, b), iters=10) / 1e12
        del a, b
        torch.cuda.empty_cache()
    except Exception as ex:  # noqa: BLE001
        log("torch ceilings failed:", type(ex).__name__, str(ex)[:200])
    n = (1 << 31) // 4 if not quick else 1 << 20
    x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
    f = jax.jit(jnp.sum)
    _, w = time_calls(f, [(x,)], reps=10)
    res["hbm_xla_sum_TBps"] = n * 4 / w / 1e12
    del x
    s = 8192 if not quick else 256
    a = jax.random.normal(jax.random.key(2), (s, s), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (s, s), jnp.bfloat16)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    c, w = time_calls(mm, [(a, b)], reps=10)
    res["mm_xla_TFLOPs"] = 2 * s**3 / (c or w) / 1e12
    del a, b
    res["hbm_TBps"] = max(v for k, v in res.items() if k.startswith("hbm"))
    res["mm_TFLOPs"] = max(v for k, v in res.items() if k.startswith("mm_"))
    return res


# ---------------------------------------------------------------------------------------------------
# data


def make_weight(key, e, n, k):
    k1, k2 = jax.random.split(key)
    packed = jax.random.bits(k1, (e, n, k // 2), jnp.uint8)
    scale = jax.random.randint(k2, (e, n, k // 32), 117, 125).astype(jnp.uint8)
    return Fp4Weight(packed, scale)


def make_routings(key, tokens, e, topk, r, k):
    """r routings: (x [M, K] bf16 sorted by expert, group_sizes [E], n_unique_experts)."""
    out = []
    for i in range(r):
        kk = jax.random.fold_in(key, i)
        k1, k2 = jax.random.split(kk)
        sc = jax.random.uniform(k1, (tokens, e))
        idx = jnp.argsort(-sc, axis=-1)[:, :topk].reshape(-1)
        gs = jnp.bincount(idx, length=e).astype(jnp.int32)
        m = tokens * topk
        x = jax.random.normal(k2, (m, k), jnp.bfloat16)
        out.append((x, gs, int(jnp.sum(gs > 0))))
    return out


def check(name, y, ref):
    y = np.asarray(y.astype(jnp.float32))
    ref = np.asarray(ref)
    finite = bool(np.isfinite(y).all())
    rel = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))
    ok = finite and rel <= 5e-3
    log(f"check {name}: rel_fro={rel:.2e} finite={finite} -> {'PASS' if ok else 'FAIL'}")
    return ok, rel


# ---------------------------------------------------------------------------------------------------
# cases


def kernel_only(x, pw, gs, cfg):
    m = x.shape[0]
    e = pw.weight.shape[0]
    t_max = eg.max_tiles(m, e, cfg.tm)
    te, tr, src, _, _ = eg.tile_schedule(gs, m, cfg.tm, t_max)
    n = pw.weight.shape[1]
    kern = eg._build_kernel(eg.padded_rows(m, e), x.shape[1], n, e, t_max, cfg, INTERPRET,
                            out_dtype=jnp.float32 if cfg.ksplit > 1 else jnp.bfloat16)
    if cfg.stream:  # the weights flattened over experts (free reshapes); without the split items' sum (the whole
        # call's row times it: XLA kernels of its own)
        call = lambda sched, x, w, s: kern(sched, x, w.reshape(e * n, -1), s.reshape(-1, n))  # noqa: E731
    else:
        call = kern
    return jax.jit(call), (eg.pack_schedule(te, tr),), src


def torch_grouped_mm(x, wbf16, gs, ref):
    """The grouped GEMM in PyTorch (scripts/torch_baselines.py: torch._grouped_mm on bf16 weights [E, N, K],
    shared with JAX through DLPack, no copy) -> (seconds per call with L2 flushed, pass, rel. error vs ref)."""
    import torch
    import torch_baselines as tb

    xt, wt, gt = (torch.from_dlpack(jax.block_until_ready(a)) for a in (x, wbf16, gs))
    y = tb.grouped_mm(xt, wt, gt)
    ok, rel = check("torch _grouped_mm", jnp.asarray(y.float().cpu().numpy()), ref)
    us = tb.cuda_time_us(lambda: tb.grouped_mm(xt, wt, gt), iters=10, flush=tb.l2_flusher())
    del xt, wt, gt, y
    torch.cuda.empty_cache()
    return us * 1e-6, ok, rel


def run_case(kind, mat, tokens, n, k, e, w, pw, wbf16, configs, ceil, args, do_mgpu):
    topk = 6
    rot = 1 if kind == "prefill" else args.rot
    routs = make_routings(jax.random.key(hash((mat, tokens)) % 2**31), tokens, e, topk, rot, k)
    m = tokens * topk
    x0, gs0, _ = routs[0]
    uniq = statistics.mean(u for _, _, u in routs)
    fp4_bytes = uniq * n * (k // 2 + k // 32) + m * k * 2 + m * n * 2
    flops = 2 * m * n * k
    # Reference: a batched dot over the groups padded to the largest, exact bf16 weights, float32 accumulation
    # (XLA lowers ragged_dot at prefill size to a dense masked dot: 360 GiB f32 / 180 GiB bf16 at M=49152; a
    # float32 copy of all 384 fused w1/w3 experts alone is 36 GB)
    g = np.asarray(gs0)
    mg = max(int(g.max()), 1)
    idx = (np.cumsum(g) - g)[:, None] + np.arange(mg)[None]
    val = np.arange(mg)[None] < g[:, None]
    xg = x0[jnp.asarray(np.where(val, idx, 0))]
    yg = jax.jit(lambda a, b: jnp.einsum("egk,enk->egn", a, b, preferred_element_type=jnp.float32,
                                         precision=jax.lax.Precision.HIGHEST))(xg, wbf16)
    ref = jnp.zeros((m, n), jnp.float32).at[jnp.asarray(idx[val])].set(yg[jnp.asarray(val)])
    del xg, yg
    ref = np.asarray(ref)

    def add(path, cfg, t_cupti, t_wall, ok=None, rel=None, note=""):
        t = t_cupti if t_cupti is not None else t_wall
        row = {"kind": kind, "mat": mat, "tokens": tokens, "M": m, "N": n, "K": k, "path": path, "cfg": label(cfg),
                   "us": t * 1e6, "wall_us": t_wall * 1e6, "cupti_us": None if t_cupti is None else t_cupti * 1e6,
                   "TBps": fp4_bytes / t / 1e12, "TFLOPs": flops / t / 1e12, "ok": ok, "rel": rel, "note": note,
                   "uniq_experts": uniq}
        row["pct_bw"] = 100 * row["TBps"] / ceil["hbm_TBps"]
        row["pct_mm"] = 100 * row["TFLOPs"] / ceil["mm_TFLOPs"]
        ROWS.append(row)
        log(f"{kind} {mat} T={tokens} {path} [{row['cfg']}]: {row['us']:.1f} us  "
            f"{row['TBps']:.2f} TB/s ({row['pct_bw']:.0f}% bw)  {row['TFLOPs']:.1f} TFLOP/s "
            f"({row['pct_mm']:.0f}% mm) {note}")

    sets = [(x, gs) for x, gs, _ in routs]
    configs = list(configs)
    for cfg in configs:
        if (mat, str(cfg)) in FAILED:
            continue
        if k % cfg.tk or n % cfg.tn or (k // cfg.tk) % cfg.ksplit:
            log(f"skip {kind} {mat} [{label(cfg)}]: does not fit N={n}, K={k}")
            continue
        if elapsed() > args.budget_s:
            log("budget reached, skipping", kind, mat, cfg)
            break
        try:
            t = time.time()
            f = jax.jit(functools.partial(eg.grouped_fp4_matmul, backend="interpret" if INTERPRET else "pallas",
                                          config=cfg))
            y = f(x0, pw, gs0)
            jax.block_until_ready(y)
            ok, rel = check(f"{kind} {mat} T={tokens} {cfg}", y, ref)
            log(f"  compile+first run {time.time() - t:.1f}s")
            c, wt = time_calls(f, [(x, pw, g) for x, g in sets])
            add("pallas", cfg, c, wt, ok, rel)
            if args.breakdown and _CUPTI_OK:
                print_breakdown(f"{kind} {mat} T={tokens} whole call", kernel_breakdown(f, (x0, pw, gs0)))
            kf, _, _ = kernel_only(x0, pw, gs0, cfg)
            ksets = []
            for x, gs in sets:  # the kernel alone: x already in its padded row layout
                _, sched, src = kernel_only(x, pw, gs, cfg)
                ksets.append((*sched, jnp.take(x, src, axis=0, mode="fill", fill_value=0), pw.weight, pw.scale_t))
            c, wt = time_calls(kf, ksets)
            add("pallas-kernel", cfg, c, wt, ok, rel)
        except Exception as ex:  # noqa: BLE001
            log(f"FAILED pallas {kind} {mat} {cfg}: {type(ex).__name__}: {str(ex)[:3000]}")
            traceback.print_exc()
            ROWS.append({"kind": kind, "mat": mat, "tokens": tokens, "path": "pallas", "cfg": label(cfg), "ok": False,
                             "note": f"{type(ex).__name__}: {str(ex)[:300]}"})
            FAILED.add((mat, str(cfg)))
            if not cfg.a_smem and dataclasses.replace(cfg, a_smem=True) not in configs:
                configs.append(dataclasses.replace(cfg, a_smem=True))  # fall back: decoded tile via smem
            if args.stop_on_fail and len(FAILED) >= 2:
                log("two kernel variants failed: stopping (--stop-on-fail)")
                dump(ceil, args)
                sys.exit(2)
    if not INTERPRET and not args.no_torch and elapsed() < args.budget_s:
        try:
            t_torch, ok, rel = torch_grouped_mm(x0, wbf16, gs0, ref)
            add("torch _grouped_mm(bf16 w)", None, None, t_torch, ok, rel,
                "PyTorch, weights pre-dequantized to bf16 (4x the bytes), CUDA events, L2 flushed")
        except Exception as ex:  # noqa: BLE001
            log(f"FAILED torch baseline {kind} {mat}: {type(ex).__name__}: {str(ex)[:500]}")
    if args.skip_baselines or kind == "prefill" or elapsed() > args.budget_s:  # XLA ragged_dot OOMs at M=49152
        return
    # XLA: the engine's current path (dequantize all experts every call + ragged_dot)
    try:
        fx = jax.jit(functools.partial(eg.grouped_fp4_matmul, backend="xla"))
        ok, rel = check(f"{kind} {mat} T={tokens} xla", fx(x0, w, gs0), ref)
        c, wt = time_calls(fx, [(x, w, g) for x, g in sets[:2]], reps=3)
        add("xla dequant+ragged_dot", None, c, wt, ok, rel)
        fr = jax.jit(lambda x, wb, g: jax.lax.ragged_dot(x, wb, g, preferred_element_type=jnp.float32
                                                         ).astype(jnp.bfloat16))
        wkn = jnp.swapaxes(wbf16, 1, 2)
        c, wt = time_calls(fr, [(x, wkn, g) for x, g in sets], reps=3)
        add("xla ragged_dot(bf16 w)", None, c, wt, None, None, "weights pre-dequantized")
    except Exception as ex:  # noqa: BLE001
        log(f"FAILED xla {kind} {mat}: {type(ex).__name__}: {str(ex)[:500]}")
    if do_mgpu and not args.no_mgpu and elapsed() < args.budget_s:
        try:
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rdm
            fm = jax.jit(lambda x, wb, g: rdm.ragged_dot(x, wb, group_sizes=g, block_m=128 if kind == "prefill" else 64,
                                                          block_n=128, block_k=64, max_concurrent_steps=4,
                                                          grid_block_n=1, transpose_rhs=True))
            t = time.time()
            ym = fm(x0, wbf16, gs0)
            jax.block_until_ready(ym)
            log(f"  ragged_dot_mgpu compile+first run {time.time() - t:.1f}s")
            ok, rel = check(f"{kind} {mat} T={tokens} ragged_dot_mgpu", ym, ref)
            c, wt = time_calls(fm, [(x, wbf16, g) for x, g in sets], reps=3)
            add("ragged_dot_mgpu(bf16 w)", None, c, wt, ok, rel, "weights pre-dequantized")
        except Exception as ex:  # noqa: BLE001
            log(f"FAILED ragged_dot_mgpu {kind} {mat}: {type(ex).__name__}: {str(ex)[:500]}")


# --moe-variants: a change to `default_config`'s decode configs (8-row tiles) for an A/B of a whole MoE layer
MOE_VARIANTS = {
    "stream": {"stream": True},  # stream-K, the partials' sum in XLA around the kernel
    "wgmma": {"warp_mma": 0, "overlap": True},  # the multiply by wgmma in two K halves (the default before warp_mma)
}


def run_moe_case(tokens, e, weights, ceil, variant=""):
    """The routed experts of one MoE layer as the engine runs them (`dsv41.moe.routed_experts` with the experts
    prepared for the kernel: w13 and w2, random top-6 routing, the served numerics): the CUPTI time of all its
    kernels against the two GEMM kernels' own, i.e. what the rows' gathers, SwiGLU and the sum over each token's
    experts cost around them. variant: a key of MOE_VARIANTS, applied to `default_config`'s decode configs."""
    if variant:
        dc, change = eg.default_config, MOE_VARIANTS[variant]
        eg.default_config = lambda *a: (lambda c: dataclasses.replace(c, **change) if c.tm == 8 else c)(dc(*a))
        try:
            return run_moe_case(tokens, e, weights, ceil)
        finally:
            eg.default_config = dc
    from dsv41 import moe, quant
    from dsv41.config import preset

    topk = 6
    n13, d = weights["w13"][0], weights["w13"][1]
    f = weights["w2"][1]
    cfg = dataclasses.replace(preset("bench"), n_routed_experts=e, n_activated_experts=topk)
    p = {"w13": weights["w13"][3], "w2": weights["w2"][3]}
    if INTERPRET:
        p = {k: dataclasses.replace(v, interpret=True) for k, v in p.items()}
    k1, k2, k3 = jax.random.split(jax.random.key(tokens), 3)
    x = jax.random.normal(k1, (tokens, d), jnp.bfloat16)
    idx = jnp.argsort(jax.random.uniform(k2, (tokens, e)), axis=-1)[:, :topk].astype(jnp.int32)
    w = jax.random.uniform(k3, (tokens, topk), jnp.float32, 0.1, 0.5)
    fn = jax.jit(lambda x, w, idx, p: moe.routed_experts(x, w, idx, p, cfg, quant.REFERENCE))
    y = fn(x, w, idx, p)
    finite = bool(jnp.isfinite(y).all())
    m = tokens * topk
    flops = 2 * m * (n13 * d + d * f)
    if not _CUPTI_OK:
        _, wall = time_calls(fn, [(x, w, idx, p)])
        log(f"moe T={tokens}: {wall * 1e6:.1f} us wall clock (no CUPTI), finite={finite}")
        return
    bd = kernel_breakdown(fn, (x, w, idx, p))
    total, count, parts = bd
    gemm = sum(us for name, us in parts if "expert_gemm" in name)
    c13 = eg.default_config(m, n13, d, e)
    row = {"kind": "moe", "mat": "w13+w2", "tokens": tokens, "M": m, "path": "routed_experts", "us": total,
           "w13_cfg": label(c13),
           "gemm_us": gemm, "TFLOPs": flops / total / 1e6, "finite": finite, "kernels": count, "parts": parts}
    MOE_ROWS.append(row)
    print(f"moe T={tokens} (w13 {label(c13)}): {total:.1f} us of {count} kernels, of it the two GEMM kernels "
          f"{gemm:.1f} us ({100 * gemm / total:.0f}%); {row['TFLOPs']:.1f} TFLOP/s = "
          f"{100 * row['TFLOPs'] / ceil['mm_TFLOPs']:.0f}% of the matmul rate (the GEMMs alone {100 * flops / gemm / 1e6 / ceil['mm_TFLOPs']:.0f}%), "
          f"finite={finite}")
    print_breakdown(f"moe T={tokens} routed experts", bd)


def dump(ceil, args):
    print()
    print(f"H200 ceilings measured in this run: HBM {ceil['hbm_TBps']:.2f} TB/s, bf16 matmul "
          f"{ceil['mm_TFLOPs']:.0f} TFLOP/s  ({json.dumps({k: round(v, 2) for k, v in ceil.items()})})")
    hdr = f"{'case':<22}{'path':<26}{'config':<34}{'us':>9}{'TB/s':>7}{'%bw':>5}{'TFLOP/s':>9}{'%mm':>5}  check"
    print(hdr)
    print("-" * len(hdr))
    for r in ROWS:
        if "us" not in r:
            print(f"{r['kind'] + ' ' + r['mat'] + ' T=' + str(r['tokens']):<22}{r['path']:<26}"
                  f"{r['cfg']:<34}  FAILED {r.get('note', '')[:60]}")
            continue
        chk = "" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL") + f" {r['rel']:.1e}"
        print(f"{r['kind'] + ' ' + r['mat'] + ' T=' + str(r['tokens']):<22}{r['path']:<26}"
              f"{r['cfg']:<34}{r['us']:>9.1f}{r['TBps']:>7.2f}{r['pct_bw']:>5.0f}"
              f"{r['TFLOPs']:>9.1f}{r['pct_mm']:>5.0f}  {chk}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_expert_gemm.json"), "w") as fh:
            json.dump({"ceilings": ceil, "rows": ROWS, "moe": MOE_ROWS, "log": LOG,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": str(jax.devices())},
                      fh, indent=1, default=str)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=330)
    ap.add_argument("--rot", type=int, default=6, help="routings rotated through when timing decode")
    ap.add_argument("--decode-tokens", default="1,8,64")
    ap.add_argument("--prefill-tokens", default="8192", help="token counts of the prefill cases, e.g. 2048,8192")
    ap.add_argument("--variants", action="store_true", help="also time non-default configs")
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch grouped GEMM baseline")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--no-mgpu", action="store_true")
    ap.add_argument("--stop-on-fail", action="store_true")
    ap.add_argument("--no-cupti", action="store_true", help="wall clock only (no CUPTI kernel timing)")
    ap.add_argument("--tiny", action="store_true", help="CPU: whole script at toy shapes, interpreter")
    ap.add_argument("--breakdown", action="store_true", help="print each kernel of the whole call (CUPTI)")
    ap.add_argument("--moe-variants", default="", help="with --moe: also each case with these changes to "
                    f"default_config's decode configs, from {','.join(MOE_VARIANTS)}")
    ap.add_argument("--moe", default="", help="token counts at which to time a whole MoE layer's routed experts "
                                              "(dsv41.moe, both GEMMs and what runs around them), e.g. 2048,8192")
    ap.add_argument("--only-moe", action="store_true", help="skip the GEMM cases (with --moe)")
    ap.add_argument("--prefill-configs", default="",
                    help="prefill configs to time instead of the default, TMxTKxSTAGES[c][o][a][n][s][wW][kK] (c: "
                         "chained; o: decode and multiply in two halves of K, KernelConfig.overlap; a: with o, an "
                         "accumulator for each half, KernelConfig.two_accs; n: no decode, timing only, its check "
                         "fails; s: stream-K, KernelConfig.stream; mM: warp-level mma.sync into M accumulators, "
                         "KernelConfig.warp_mma; wW: W "
                         "compute warpgroups, default 2; kK: K slices, "
                         "KernelConfig.ksplit), e.g. "
                         "128x128x4,64x256x4co,8x256x4cok5")
    ap.add_argument("--decode-configs", default="", help="decode configs to time instead of the default, as "
                                                         "--prefill-configs")
    args = ap.parse_args()
    global INTERPRET
    INTERPRET = args.tiny
    global _CUPTI_OK
    _CUPTI_OK = False if args.no_cupti or args.tiny else None
    log("jax", jax.__version__, jax.devices())
    C = eg.KernelConfig
    if args.cpu_smoke:
        from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: F401
        e = 4
        x = jax.random.normal(jax.random.key(0), (12, 128), jnp.bfloat16)
        w = make_weight(jax.random.key(1), e, 128, 128)
        gs = jnp.array([5, 0, 4, 3], jnp.int32)
        ref = eg.expert_gemm_reference(x, w, gs)
        y = eg.grouped_fp4_matmul(x, w, gs, backend="interpret", config=C(tm=8, tk=64, num_wgs=1, stages=2))
        ok, _ = check("cpu-smoke interpret", y, ref)
        y = eg.grouped_fp4_matmul(x, w, gs, backend="xla")
        ok2, _ = check("cpu-smoke xla", y, ref)
        sys.exit(0 if ok and ok2 else 1)

    ceil = ceilings(args.tiny)
    try:
        _cases(args, ceil)
    except KeyboardInterrupt:  # `timeout -s INT`: keep what was measured
        log("interrupted")
    dump(ceil, args)


def parse_configs(spec):
    """'TMxTKxSTAGES[c][o][a][n][s][mM][wW][kK],...' -> [KernelConfig], or None. c: chained, o: overlap, a: an
    accumulator for each K half (two_accs, with o), n: no decode (timing only: KernelConfig.skip_decode), s:
    stream-K (KernelConfig.stream), mM: warp-level mma.sync into M accumulators (KernelConfig.warp_mma), wW: W
    compute warpgroups (default 2), kK: K slices (ksplit). A config that does not fit a weight's N or K is
    skipped for that weight."""
    out = []
    for item in filter(None, spec.split(",")):
        tm, tk, st = item.split("x")
        m = re.fullmatch(r"(\d+)([coans]*)(?:m(\d))?(?:w(\d))?(?:k(\d+))?", st)
        if m is None:
            raise SystemExit(f"config {item!r}: expected TMxTKxSTAGES[c][o][a][n][s][mM][wW][kK], e.g. 8x256x4co, "
                             "8x256x4cm4, 8x256x4cow3 or 8x256x4cok5")
        flags = m.group(2)
        out.append(eg.KernelConfig(tm=int(tm), tk=int(tk), num_wgs=int(m.group(4) or 2), stages=int(m.group(1)),
                                   chain="c" in flags, overlap="o" in flags, two_accs="a" in flags,
                                   skip_decode="n" in flags, stream="s" in flags, warp_mma=int(m.group(3) or 0),
                                   ksplit=int(m.group(5) or 1)))
    return out or None


def _cases(args, ceil):
    C = eg.KernelConfig
    log("ceilings", json.dumps({k: round(v, 3) for k, v in ceil.items()}))
    e = 384
    shapes = {"w13": (4608, 5120), "w2": (5120, 2304)}  # w1 and w3 as one weight, as backends.prepare_experts does
    if args.tiny:
        e, shapes = 8, {"w13": (256, 256), "w2": (256, 128)}  # D 256, F 128
    weights = {}
    for i, (mat, (n, k)) in enumerate(shapes.items()):
        w = make_weight(jax.random.key(10 + i), e, n, k)
        pw = eg.prepare_fp4_experts(w)
        # [E, N, K], a few experts at a time (dequantize goes through float32); the GEMM cases' reference only
        wbf16 = None if args.only_moe else jnp.concatenate([jax.jit(
            lambda q, sc: Fp4Weight(q, sc).dequantize(jnp.bfloat16))(w.weight[j:j + 32], w.scale[j:j + 32])
            for j in range(0, e, 32)])
        jax.block_until_ready((pw, wbf16))
        weights[mat] = (n, k, w, pw, wbf16)
    log("weights ready")

    dec_cfgs = parse_configs(args.decode_configs)  # None: per weight, eg.default_config's decode config
    pre_cfgs = parse_configs(args.prefill_configs)  # None: per case, eg.default_config's
    # variants: pipeline depth (bytes in flight), compute warpgroups, and items chained into one TMA stream;
    # (K / tk) % stages == 0 for a config to chain (w13: 20 steps of 256, w2: 9). Not here: 4 compute
    # warpgroups (tk=128, 8 stages, chained) hung on the H200 (2026-11-30) and took the run with it.
    dec_var = [C(tm=8, tk=256, num_wgs=2, stages=4), C(tm=8, tk=256, num_wgs=2, stages=4, chain=True),
               C(tm=8, tk=256, num_wgs=2, stages=3, chain=True),
               C(tm=8, tk=256, num_wgs=2, stages=8), C(tm=8, tk=128, num_wgs=2, stages=6, chain=True),
               C(tm=8, tk=256, num_wgs=1, stages=6)]
    # K slices at decode (more, smaller items than 1-2 uneven waves of experts x N blocks): per weight, as the
    # slices must divide its K steps (w13: 40 of 128, w2: 18 of 128)
    dec_split = {"w13": [C(tm=8, tk=128, num_wgs=2, stages=4, chain=True, ksplit=5),
                         C(tm=8, tk=128, num_wgs=2, stages=4, chain=True, ksplit=2),
                         C(tm=8, tk=256, num_wgs=2, stages=2, chain=True, ksplit=2)],
                 "w2": [C(tm=8, tk=128, num_wgs=2, stages=3, chain=True, ksplit=2),
                        C(tm=8, tk=128, num_wgs=2, stages=3, chain=True, ksplit=3),
                        C(tm=8, tk=128, num_wgs=2, stages=3, chain=True, ksplit=6)]}
    pre_var = [C(tm=128, tk=128, num_wgs=2, stages=4, chain=True), C(tm=128, tk=64, num_wgs=2, stages=5, chain=True),
               C(tm=192, tk=64, num_wgs=2, stages=5, chain=True), C(tm=64, tk=128, num_wgs=2, stages=5)]
    if args.tiny:
        dec_cfgs, pre_cfgs = [C(tm=8, tk=64, num_wgs=1, stages=2)], [C(tm=16, tk=64, num_wgs=2, stages=2)]
        dec_var, pre_var = [C(tm=8, tk=64, num_wgs=2, stages=2)], [C(tm=8, tk=64, num_wgs=1, stages=2)]
        dec_split = {mat: [C(tm=8, tk=64, num_wgs=1, stages=1, ksplit=2)] for mat in shapes}
    dec = [int(t) for t in args.decode_tokens.split(",") if t]
    for tokens in (int(t) for t in args.moe.split(",") if t):
        if elapsed() > args.budget_s:
            log("budget reached, skipping moe", tokens)
            continue
        run_moe_case(tokens, e, weights, ceil)
        for v in filter(None, args.moe_variants.split(",")):
            run_moe_case(tokens, e, weights, ceil, variant=v)
    if args.only_moe:
        return
    pre = [int(t) for t in args.prefill_tokens.split(",") if t]
    # priority order (the budget cuts the tail): largest decode, prefill, the other decodes, then variants
    cases = [("decode", t) for t in sorted(dec)[-1:]] + ([] if args.skip_prefill else [("prefill", t) for t in pre])
    cases += [("decode", t) for t in sorted(dec)[:-1]]
    for kind, tokens in cases:
        for mat, (n, k, w, pw, wbf16) in weights.items():
            if elapsed() > args.budget_s:
                log("budget reached, skipping", kind, tokens, mat)
                continue
            cfgs = (dec_cfgs if kind == "decode" else pre_cfgs) or [eg.default_config(tokens * 6, n, k, e)]
            run_case(kind, mat, tokens, n, k, e, w, pw, wbf16, cfgs,
                     ceil, args, do_mgpu=(kind == "prefill" and mat == "w13"))
    if args.variants:
        vcases = [("decode", min(dec), "w13"), ("decode", min(dec), "w2"), ("decode", max(dec), "w13"),
                  ("decode", max(dec), "w2")]
        if not args.skip_prefill:
            vcases.insert(1, ("prefill", pre[-1], "w13"))
        for kind, tokens, mat in vcases:
            n, k, w, pw, wbf16 = weights[mat]
            if elapsed() > args.budget_s:
                log("budget reached, skipping variants", kind, tokens, mat)
                continue
            run_case(kind, mat, tokens, n, k, e, w, pw, wbf16, dec_split[mat] + dec_var if kind == "decode" else pre_var,
                     ceil, argparse.Namespace(**{**vars(args), "skip_baselines": True}), do_mgpu=False)


if __name__ == "__main__":
    main()
