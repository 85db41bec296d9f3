#!/usr/bin/env python3
"""Check and time the fused mHC site (pallas_kernels/mhc.py) at Flash shapes (hc=4, D=5120, fn [24, 20480]).

On the H200:  PYTHONUNBUFFERED=1 PYTHONPATH=. timeout 150 python3 scripts/bench_mhc.py --out $OUT
On a CPU (script logic only, toy shapes, interpreter): .venv/bin/python scripts/bench_mhc.py --tiny

One process:
1. HBM ceiling in the same run (bench_sparse_attention.copy_bandwidth: PyTorch 2 GiB d2d copy and an XLA f32
   copy, read+write bytes; the best of the two);
2. per T in --tokens (default 64, 1, 8, 512; decode first): fresh random inputs, the pallas path vs the XLA
   path (the dsv41.mhc composition the model runs, jitted) -> PASS/FAIL with max errors: h1 within
   two bf16 ulps (+1e-6 absolute) on <= 1% of elements vs the reference; x (same rule) and pre/post/comb (abs
   <= 2e-5) vs the reference applied to the kernel's own h1 (a bf16 tie flip in h1 moves the mix values by
   |fn| * ulp, which is not a kernel error; the pre error vs the plain reference is printed as info);
   every output finite;
3. times with CUPTI (median over --iters calls after warm-up; the sum of the GPU time of every kernel the
   call launches, so launch count matters; falls back to wall clock): pallas whole path (kernel + XLA
   epilogue), the Mosaic kernel alone, and the XLA path; roofline = bytes / ceiling, bytes = fn (f32) + h, y
   read + h1, x written; plus the median wall clock of one blocking call of each path (launch gaps are real
   costs the CUPTI sum does not see);
4. then the first site (y=None) and config variants while --budget-s lasts;
5. prints one table and writes bench_mhc.json to --out.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from dsv41.config import ModelConfig
from pallas_kernels import mhc as M

T0 = time.time()
ROWS: list[dict] = []


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def make_inputs(key, t, d, hc=4):
    k = jax.random.split(key, 9)
    y = jax.random.normal(k[0], (t, d)).astype(jnp.bfloat16)
    h = (jax.random.normal(k[1], (t, hc, d)) * 3).astype(jnp.bfloat16)
    post = 2 * jax.nn.sigmoid(jax.random.normal(k[2], (t, hc)))
    comb = jax.nn.softmax(jax.random.normal(k[3], (t, hc, hc)), -1)
    pre = jax.nn.sigmoid(jax.random.normal(k[4], (t, hc))) + 1e-6
    fn = jax.random.normal(k[5], (24, hc * d)) * 0.02
    scale = jax.random.uniform(k[6], (3,), minval=0.5, maxval=2.0)
    base = jax.random.normal(k[7], (24,))
    w = (1 + 0.1 * jax.random.normal(k[8], (d,))).astype(jnp.bfloat16)
    return [y, h, post, comb, pre, fn, scale, base, w]


def compare(out, ref):
    """-> (ok, {name: error figure})."""
    errs, ok = {}, True
    for name, o, r in zip(("h1", "x", "pre", "post", "comb"), out, ref):
        o = np.asarray(jnp.asarray(o, jnp.float32))
        r = np.asarray(jnp.asarray(r, jnp.float32))
        if o.shape != r.shape or not np.all(np.isfinite(o)):
            errs[name] = "shape/nonfinite"
            ok = False
            continue
        if name in ("h1", "x"):  # the rule of tests/pallas_kernels/test_mhc.py: <= 2 bf16 ulps (+1e-6 absolute:
            # near-zero results of cancelling sums), on <= 1% of elements
            excess = float(np.max(np.abs(o - r) - (2 ** -6 * np.abs(r) + 1e-6)))
            frac = float(np.mean(o != r))
            errs[name] = f"excess {max(excess, 0):.1e} differ {frac:.1e}"
            ok &= bool(excess <= 0 and frac <= 0.01)
        else:
            e = float(np.max(np.abs(o - r)))
            errs[name] = f"{e:.1e}"
            ok &= e <= 2e-5
    return ok, errs


def op_bytes(t, hc, d, first):
    """fn (f32) + h read and h1 written (the first site writes no h1) + y read (not at the first site) + x."""
    fn = 24 * hc * d * 4
    return fn + t * hc * d * 2 * (1 if first else 2) + t * d * 2 * (1 if first else 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--tokens", default="64,1,8,512")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=110)
    ap.add_argument("--variants", default="128:16,128:32,256:4,128:2", help="dc:tt configs timed after the main rows")
    ap.add_argument("--tiny", action="store_true", help="CPU: toy shapes through the interpreter")
    args = ap.parse_args()
    cfg = ModelConfig()
    hc, d = cfg.hc_mult, cfg.dim
    backend = "pallas"
    if args.tiny:
        d, args.tokens, args.iters, args.variants, backend = 256, "2", 1, "", "interpret"
    tokens = [int(v) for v in args.tokens.split(",") if v]
    log("devices", jax.devices())

    import bench_sparse_attention as bsa  # CUPTI timing + copy ceiling helpers

    bsa.log = log
    ceil = {}
    if not args.tiny:
        try:
            ceil = bsa.copy_bandwidth()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    bw = max(ceil.values()) if ceil else 4.3
    log("ceilings", ceil, "-> using", f"{bw:.2f} TB/s")

    def timed(f, a):
        if args.tiny:
            t = time.perf_counter()
            jax.block_until_ready(f(*a))
            return (time.perf_counter() - t) * 1e3, 0, ["wall"]
        tot, mx, names = bsa.time_gpu(f, a, iters=args.iters)
        return tot, mx, names

    def wall(f, a, reps=None):
        """Median wall-clock us of one blocking call: includes launch gaps and host work, which the CUPTI kernel
        sum does not see."""
        jax.block_until_ready(f(*a))
        ts = []
        for _ in range(reps or args.iters):
            t = time.perf_counter()
            jax.block_until_ready(f(*a))
            ts.append((time.perf_counter() - t) * 1e6)
        return float(np.median(ts))

    def run_case(t, first, kc, label, with_xla=True):
        row = {"T": t, "site": "first" if first else "expand", "config": label}
        ROWS.append(row)
        try:
            a = make_inputs(jax.random.key(1000 + t), t, d)
            if first:
                a[0] = a[2] = a[3] = None
            pal = jax.jit(lambda *b: M.mhc_fused(*b, cfg, backend=backend, config=kc))
            xla = jax.jit(lambda *b: M.mhc_fused(*b, cfg, backend="xla"))
            out = jax.block_until_ready(pal(*a))
            ref = jax.block_until_ready(xla(*a))
            ok, errs = compare(out[:1], ref[:1])  # h1 vs the reference; the rest vs the reference on our h1
            cond = jax.block_until_ready(xla(None, out[0], None, None, *a[4:]))
            ok2, errs2 = compare(out, cond)
            ok &= ok2
            errs.update({k: v for k, v in errs2.items() if k != "h1"})
            errs["h1->coef (info)"] = compare(out, ref)[1]["pre"]
            row.update(check="PASS" if ok else "FAIL", errors=errs)
            nbytes = op_bytes(t, hc, d, first)
            row["MB"] = nbytes / 1e6
            row["roofline_us"] = nbytes / (bw * 1e12) * 1e6
            tot, mx, names = timed(pal, a)
            row.update(pallas_us=tot * 1e3, pallas_kernel_us=mx * 1e3, pallas_launches=len(names),
                       pallas_kernels=names, pallas_wall_us=wall(pal, a))
            if with_xla:
                tx, _, nx = timed(xla, a)
                row.update(xla_us=tx * 1e3, xla_launches=len(nx), xla_kernels=nx, xla_wall_us=wall(xla, a))
            log({k: v for k, v in row.items() if not k.endswith("_kernels")})
        except Exception as ex:  # noqa: BLE001
            traceback.print_exc()
            row.update(check="ERROR", error=f"{type(ex).__name__}: {str(ex)[:300]}")
        dump(args, ceil)

    for t in tokens:
        run_case(t, False, None, "default")
    for t in tokens:
        if time.time() - T0 > args.budget_s:
            log("budget reached, skipping the rest")
            break
        run_case(t, True, None, "default")
    for v in [v for v in args.variants.split(",") if v]:
        dc, tt = (int(x) for x in v.split(":"))
        for t in tokens:
            if time.time() - T0 > args.budget_s:
                break
            run_case(t, False, M.KernelConfig(dc=dc, tt=tt), f"dc{dc} tt{tt}", with_xla=False)
    table(bw)
    dump(args, ceil)


def table(bw):
    print(f"\nfused mHC site, hc=4, roofline at {bw:.2f} TB/s (bytes: fn f32 + h, y in + h1, x out); "
          "us columns: CUPTI GPU time summed over the call's kernels (#k), kernel = the longest one; "
          "wall = one blocking call")
    hdr = (f"{'T':>4} {'site':>6} {'config':>11} {'check':>5} {'pallas us':>9} {'kernel us':>9} {'#k':>3} "
           f"{'xla us':>8} {'#k':>3} {'roof us':>7} {'xla/pal':>7} {'roof/pal':>8} {'wall pal':>8} "
           f"{'wall xla':>8}  errors")
    print(hdr)
    for r in ROWS:
        p, x, rf = r.get("pallas_us"), r.get("xla_us"), r.get("roofline_us")
        f = lambda v, w=9, p_=1: f"{v:{w}.{p_}f}" if isinstance(v, float) else f"{'-':>{w}}"
        print(f"{r['T']:>4} {r['site']:>6} {r['config']:>11} {r.get('check', '?'):>5} {f(p)} "
              f"{f(r.get('pallas_kernel_us'))} {r.get('pallas_launches', '-'):>3} {f(x, 8)} "
              f"{r.get('xla_launches', '-'):>3} {f(rf, 7, 2)} "
              f"{f(x / p if p and x else None, 7, 2)} {f(rf / p if p and rf else None, 8, 3)} "
              f"{f(r.get('pallas_wall_us'), 8)} {f(r.get('xla_wall_us'), 8)}  {r.get('errors', r.get('error', ''))}")


def dump(args, ceil):
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_mhc.json"), "w") as fh:
        json.dump({"ceilings": ceil, "rows": ROWS, "elapsed_s": time.time() - T0}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
