"""FP8 linear kernel (pallas_kernels/fp8_linear.py) vs XLA at Flash's FP8 linear shapes, decode batch sizes.

For every linear the model runs through `nn.linear` with an FP8 weight (release format: e4m3 + UE8M0 per 32x32):
the kernel checked against the float32 reference, then timed against XLA's path (dequantize + dot, what the
engine runs with `--linear-backend xla`), XLA's dot on a bf16 copy of the weight, and the roofline (the bytes
the kernel must read / measured HBM bandwidth). Times are CUPTI kernel sums per call (no dispatch), over
enough weight copies that they do not stay in the 50 MB L2. `--skip-decode` also times the kernel with its
words going to wgmma undecoded (`KernelConfig.skip_decode`, wrong results): what the FP8 decode's integer work
costs, as it cost the FP4 expert GEMM 22-26% (twenty-first session). `--variants halves,accs` also times (and
checks) the kernel decoding and multiplying each step in two halves of K (`KernelConfig.overlap`, which the
expert GEMM's decode configs use), and that with an accumulator for each half (`two_accs`).

    PYTHONPATH=. python3 scripts/bench_fp8_linear.py [--rows 1,8,64] [--out DIR] [--skip-decode]
                                                     [--variants halves,accs]
    PYTHONPATH=. python3 scripts/bench_fp8_linear.py --tiny     # CPU: the interpreter at toy shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_engine import measure_hbm

from dsv41.quant import Fp8Weight
from pallas_kernels import expert_gemm as eg
from pallas_kernels import fp8_linear as f8

log = logging.getLogger("bench_fp8_linear")

# name -> (N out, K in) at Flash's widths (dim 5120, q-LoRA 1280, 64x512 heads, 8x1024 output groups, 32x128
# indexer, shared expert 2304, Engram 24 x 256 columns into 5 x 5120)
SHAPES = {"attn.wq_a": (1280, 5120), "attn.wq_b": (32768, 1280), "attn.wkv": (512, 5120),
          "attn.wo_b": (5120, 8192), "indexer.wq_b": (4096, 1280), "shared.w1 (w3 alike)": (2304, 5120),
          "shared.w2": (5120, 2304), "engram.wkv": (25600, 6144)}
# --variants: KernelConfig fields changed from fp8_linear's own config (which multiplies with mma.sync up to 8 rows)
VARIANTS = {"halves": {"overlap": True, "warp_mma": 0}, "accs": {"overlap": True, "two_accs": True, "warp_mma": 0},
            "wgmma": {"warp_mma": 0}, "mma": {"warp_mma": 4}}


def random_fp8(key, n, k):
    raw = np.asarray(jax.random.bits(key, (n, k), jnp.uint8))
    raw = np.where((raw & 0x7F) == 0x7F, 0x3C, raw).astype(np.uint8)  # no NaN codes
    scale = np.asarray(jax.random.randint(jax.random.fold_in(key, 1), (n // 32, k // 32), 112, 124)).astype(np.uint8)
    return Fp8Weight(jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale))


def kernel_ms(fn, arg_sets, reps: int) -> float:
    """Median over reps of the CUPTI kernel time of one call (summed over the kernels it launches)."""
    from profile_step import cupti_kernels

    jax.block_until_ready([fn(*a) for a in arg_sets])
    per = []
    for _ in range(reps):
        ks = cupti_kernels(lambda: jax.block_until_ready([fn(*a) for a in arg_sets]))
        per.append(sum(ms for _, ms in ks) / len(arg_sets))
    return statistics.median(per)


def wall_ms(fn, arg_sets, reps: int) -> float:
    jax.block_until_ready([fn(*a) for a in arg_sets])
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for a in arg_sets:
            jax.block_until_ready(fn(*a))  # one at a time: the interpreter is not re-entrant
        ts.append((time.perf_counter() - t) / len(arg_sets) * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--only", default="", help="comma-separated names of SHAPES")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--skip-decode", action="store_true", help="also time the kernel without its decode (GPU)")
    ap.add_argument("--variants", default="", help="also time these configs, checked: halves (K halves, "
                                                    "KernelConfig.overlap), accs (K halves, an accumulator each), "
                                                    "wgmma (whole steps), mma (warp-level mma.sync, 4 accumulators: "
                                                    "KernelConfig.warp_mma; up to 16 rows, skipped past them)")
    args = ap.parse_args()
    unknown = set(filter(None, args.variants.split(","))) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants {','.join(sorted(unknown))}: choose from {','.join(VARIANTS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    gpu = jax.default_backend() == "gpu"
    if not gpu and not args.tiny:
        sys.exit("bench_fp8_linear.py times the kernel on a GPU; --tiny runs it in the interpreter")
    shapes = {"tiny.a": (256, 512), "tiny.b": (128, 256)} if args.tiny else SHAPES
    if args.only:
        shapes = {k: v for k, v in shapes.items() if k in args.only.split(",")}
    rows = [int(r) for r in args.rows.split(",") if r]
    hbm = measure_hbm(0.25 if args.tiny else 4.0)
    timer = kernel_ms if gpu else wall_ms
    reps = args.reps if gpu else 1
    log.info("HBM %.2f TB/s (XLA f32 scale, read + write)", hbm / 1e12)
    xla = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w.dequantize(jnp.bfloat16),
                                          preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    dot = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32
                                          ).astype(jnp.bfloat16))
    kern = jax.jit(f8.fp8_linear)
    results = []
    for name, (n, k) in shapes.items():
        copies = 1 if args.tiny else max(2, -(-200 * 2**20 // (n * k)))  # > 4x the L2 in all
        ws = [random_fp8(jax.random.key(i), n, k) for i in range(copies)]
        pws = [f8.prepare_fp8_linear(w, interpret=not gpu) for w in ws]
        bfs = [w.dequantize(jnp.bfloat16) for w in ws] if gpu else []
        for m in rows:
            x = jax.random.normal(jax.random.key(m), (m, k)).astype(jnp.bfloat16)
            y = kern(x, pws[0])
            ref = np.asarray(f8.fp8_linear_reference(x, ws[0]), np.float64)
            yf = np.asarray(y.astype(jnp.float32), np.float64)
            rel = float(np.linalg.norm(yf - ref) / np.linalg.norm(ref))
            ok = bool(np.isfinite(yf).all()) and rel < 5e-3
            t_k = timer(kern, [(x, p) for p in pws], reps)
            t_nd = float("nan")
            tm, splits = max(8, -(-m // 8) * 8), pws[0].splits
            own = f8._config(tm, k // f8.TK // splits, splits)  # what fp8_linear runs
            if args.skip_decode and gpu:
                nd = dataclasses.replace(own, skip_decode=True)
                t_nd = timer(jax.jit(lambda x, w, c=nd: f8.fp8_linear(x, w, c)), [(x, p) for p in pws], reps)
            variants = {}
            for v in filter(None, args.variants.split(",")):
                cfg = dataclasses.replace(own, **VARIANTS[v])
                if cfg.warp_mma and tm > eg.WARP_MMA_MAX_TM:  # the kernel refuses it
                    variants[v] = {"ms": float("nan"), "rel": float("nan"), "check": True}
                    continue
                f = jax.jit(lambda x, w, c=cfg: f8.fp8_linear(x, w, c))
                yv = np.asarray(f(x, pws[0]).astype(jnp.float32), np.float64)
                rv = float(np.linalg.norm(yv - ref) / np.linalg.norm(ref))
                variants[v] = {"ms": timer(f, [(x, p) for p in pws], reps), "rel": rv,
                               "check": bool(np.isfinite(yv).all()) and rv < 5e-3}
            t_x = timer(xla, [(x, w) for w in ws], reps) if gpu else float("nan")
            t_b = timer(dot, [(x, b) for b in bfs], reps) if gpu else float("nan")
            roof = (n * k * (1 + 1 / 32) + m * k * 2 + m * n * 2) / hbm * 1e3
            r = {"linear": name, "N": n, "K": k, "rows": m, "splits": pws[0].splits, "check": ok,
                 "rel": rel, "kernel_ms": t_k, "no_decode_ms": t_nd, "xla_ms": t_x, "bf16_ms": t_b, "roofline_ms": roof,
                 "variants": variants}
            results.append(r)
            log.info("%s", json.dumps(r))
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; HBM "
          f"{hbm / 1e12:.2f} TB/s (XLA f32 scale, read + write); times: {'CUPTI kernel sums' if gpu else 'wall'}"
          f" per call, us\n")
    nd = args.skip_decode and gpu
    vs = list(filter(None, args.variants.split(",")))
    print("| linear | N x K | rows | K splits | check | kernel |" + (" kernel, no decode |" if nd else "")
          + "".join(f" kernel, {v} (check) |" for v in vs)
          + " XLA dequantize + dot | XLA dot, bf16 weight | roofline | kernel of roofline | vs XLA |")
    print("|---|---|---|---|---|---|" + ("---|" if nd else "") + "---|" * len(vs) + "---|---|---|---|---|")
    for r in results:
        print(f"| {r['linear']} | {r['N']} x {r['K']} | {r['rows']} | {r['splits']} | "
              f"{'PASS' if r['check'] else 'FAIL'} {r['rel']:.1e} | {r['kernel_ms'] * 1e3:.1f} | "
              + (f"{r['no_decode_ms'] * 1e3:.1f} | " if nd else "")
              + "".join("n/a | " if np.isnan(r['variants'][v]['ms']) else
                        f"{r['variants'][v]['ms'] * 1e3:.1f} ({'PASS' if r['variants'][v]['check'] else 'FAIL'}) | "
                        for v in vs) +
              f"{r['xla_ms'] * 1e3:.1f} | {r['bf16_ms'] * 1e3:.1f} | {r['roofline_ms'] * 1e3:.1f} | "
              f"{100 * r['roofline_ms'] / r['kernel_ms']:.0f}% | {r['xla_ms'] / r['kernel_ms']:.1f}x |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_fp8_linear.json"), "w") as fh:
            json.dump({"hbm": hbm, "results": results}, fh, indent=1)
    sys.exit(0 if all(r["check"] and all(v["check"] for v in r["variants"].values()) for r in results) else 1)


if __name__ == "__main__":
    main()
