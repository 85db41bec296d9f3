"""FP8 linear kernel (pallas_kernels/fp8_linear.py) vs XLA at Flash's FP8 linear shapes, decode batch sizes.

    PYTHONPATH=. python3 scripts/bench_fp8_linear.py [--rows 1,8,64] [--out DIR] [--only attn.wq_b,engram.wkv]

Each linear (e4m3 + UE8M0 per 32x32) checked against the float32 reference, then timed (scripts/timing.py: CUPTI
kernel sums a call, over weight copies past the L2) against XLA's dequantize + dot (`--linear-backend xla`), XLA's
dot on a bf16 copy, and the roofline (bytes read / the HBM ceiling measured in the same run).
"""

from __future__ import annotations

import json
import sys

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41.quant import Fp8Weight
from pallas_kernels import fp8_linear as f8

# name -> (N out, K in) at Flash's widths (dim 5120, q-LoRA 1280, 64x512 heads, 8x1024 output groups, 32x128
# indexer, shared expert 2304, Engram 24 x 256 columns into 5 x 5120)
SHAPES = {"attn.wq_a": (1280, 5120), "attn.wq_b": (32768, 1280), "attn.wkv": (512, 5120),
          "attn.wo_b": (5120, 8192), "indexer.wq_b": (4096, 1280), "shared.w1 (w3 alike)": (2304, 5120),
          "shared.w2": (5120, 2304), "engram.wkv": (25600, 6144)}


def random_fp8(key, n, k):
    raw = np.asarray(jax.random.bits(key, (n, k), jnp.uint8))
    raw = np.where((raw & 0x7F) == 0x7F, 0x3C, raw).astype(np.uint8)  # no NaN codes
    scale = np.asarray(jax.random.randint(jax.random.fold_in(key, 1), (n // 32, k // 32), 112, 124)).astype(np.uint8)
    return Fp8Weight(jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale))


def main():
    ap = timing.bench_args(__doc__)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--only", default="", help="comma-separated names of SHAPES")
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("bench_fp8_linear.py times the kernel on a GPU")
    shapes = {k: v for k, v in SHAPES.items() if not args.only or k in args.only.split(",")}
    ceil = timing.bench_ceilings()
    hbm = ceil["hbm_TBps"] * 1e12

    def timer(fn, arg_sets):  # ms a call: CUPTI (wall clock where CUPTI is unavailable)
        c, w = timing.time_calls(fn, arg_sets)
        return (c if c is not None else w) * 1e3

    xla = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w.dequantize(jnp.bfloat16),
                                          preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    dot = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32
                                          ).astype(jnp.bfloat16))
    kern = jax.jit(f8.fp8_linear)
    results, table = [], []
    for name, (n, k) in shapes.items():
        copies = max(2, -(-200 * 2**20 // (n * k)))  # > 4x the L2 in all
        ws = [random_fp8(jax.random.key(i), n, k) for i in range(copies)]
        pws = [f8.prepare_fp8_linear(w) for w in ws]
        bfs = [w.dequantize(jnp.bfloat16) for w in ws]
        for m in (int(r) for r in args.rows.split(",") if r):
            x = jax.random.normal(jax.random.key(m), (m, k)).astype(jnp.bfloat16)
            ref = np.asarray(f8.fp8_linear_reference(x, ws[0]), np.float64)
            yf = np.asarray(kern(x, pws[0]).astype(jnp.float32), np.float64)
            rel = float(np.linalg.norm(yf - ref) / np.linalg.norm(ref))
            r = {"linear": name, "N": n, "K": k, "rows": m, "splits": pws[0].splits,
                 "check": bool(np.isfinite(yf).all()) and rel < 5e-3, "rel": rel,
                 "kernel_ms": timer(kern, [(x, p) for p in pws]),
                 "xla_ms": timer(xla, [(x, w) for w in ws]), "bf16_ms": timer(dot, [(x, b) for b in bfs]),
                 "roofline_ms": (n * k * (1 + 1 / 32) + m * k * 2 + m * n * 2) / hbm * 1e3}
            results.append(r)
            timing.log(json.dumps(r))
            table.append([name, f"{n} x {k}", m, r["splits"], f"{'PASS' if r['check'] else 'FAIL'} {rel:.1e}",
                          *(f"{r[c] * 1e3:.1f}" for c in ("kernel_ms", "xla_ms", "bf16_ms", "roofline_ms")),
                          f"{100 * r['roofline_ms'] / r['kernel_ms']:.0f}%", f"{r['xla_ms'] / r['kernel_ms']:.1f}x"])
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; ceilings: {timing.ceiling_line(ceil)}; times: "
          "CUPTI kernel sums per call, us\n")
    timing.print_table(["linear", "N x K", "rows", "K splits", "check", "kernel", "XLA dequantize + dot",
                        "XLA dot, bf16 weight", "roofline", "kernel of roofline", "vs XLA"], table, "ll" + "r" * 9)
    timing.write_json(args.out, "bench_fp8_linear.json", {"ceilings": ceil, "results": results})
    sys.exit(0 if all(r["check"] for r in results) else 1)


if __name__ == "__main__":
    main()
