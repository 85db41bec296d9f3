"""A prefill chunk's indexer scores by XLA's path (`dsv41.indexer.raw_scores`, what the engine's prefill runs by
default), the same with the q.k products written in bf16 instead of float32, the chunk kernel
(`pallas_kernels.indexer_chunk`, `KernelOptions.prefill_indexer_kernel`) and, on a GPU, PyTorch's einsum path
(scripts/torch_baselines.py). Prints one table (markdown) against the roofline: the q.k GEMM's FLOPs at the bf16
matmul rate measured in the same run.

    PYTHONPATH=. python3 scripts/bench_index_scores.py [--queries 2048] [--entries 4096,16384,65536]

Why: score = bf16(sum_h bf16(relu(bf16(q_h . k)) * w_h)). XLA runs the q.k einsum as one GEMM whose float32
output [queries, heads, entries] is written to HBM and read back by the fusion doing relu, weights and the head
sum: 8 bytes of traffic per product (8 GiB per block of 2048 queries x 32 heads x 16K entries), where the GEMM
itself is ~0.4 ms. The products are rounded to bf16 first thing in that fusion, so the GEMM can write them in
bf16 (one rounding of the float32 accumulator, the same one): 4 bytes per product. The kernel keeps them in
registers. The XLA variants are compared bit for bit with today's (on the CPU they are equal: tests/test_model.py);
the kernel sums in another order, so its column is the fraction of scores equal to today's and the largest
difference in bf16 steps (one step where a different float32 order crosses a rounding point).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_engine, torch_baselines
from bench_engine import measure_hbm, measure_mxu, timed  # noqa: E402
from dsv41 import indexer  # noqa: E402
from pallas_kernels import indexer_chunk as ic  # noqa: E402

log = logging.getLogger("bench_index_scores")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=2048, help="a prefill chunk")
    ap.add_argument("--entries", default="4096,16384,65536", help="compressed entries G (context / ratio)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch row (scripts/torch_baselines.py)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    S, IH, ID = args.queries, args.heads, args.head_dim
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    rate, bw = measure_mxu(8192 if gpu else 512), measure_hbm(1.0 if gpu else 1 / 64)
    xla = jax.jit(indexer.raw_scores, static_argnums=(3, 4))
    kernel = jax.jit(lambda q, w, k: ic.chunk_scores(q, w, k, jnp.full(q.shape[:2], k.shape[1], jnp.int32),
                                                      interpret=not gpu))
    variants = {  # name -> (scores(q, w, k) -> blocked result, product bytes written and read per product)
        "XLA, float32 products (today)": (lambda q, w, k: xla(q, w, k, jnp.bfloat16, False).block_until_ready(), 8),
        "XLA, bf16 products": (lambda q, w, k: xla(q, w, k, jnp.bfloat16, True).block_until_ready(), 4),
        "kernel (indexer_chunk)": (lambda q, w, k: kernel(q, w, k).block_until_ready(), 0),
    }
    if gpu and not args.no_torch:
        variants["PyTorch (einsum, bf16 products)"] = (torch_scores, 4)
    rows = []  # (G, name, seconds, agreement with today)
    for G in [int(g) for g in args.entries.split(",")]:
        kq, kk, kw = jax.random.split(jax.random.key(G), 3)
        q = jax.random.normal(kq, (1, S, IH, ID), jnp.bfloat16)
        k = jax.random.normal(kk, (1, G, ID), jnp.bfloat16)
        w = jax.random.normal(kw, (1, S, IH), jnp.bfloat16)
        today = None
        for name, (fn, _) in variants.items():
            try:
                out = np.asarray(fn(q, w, k))  # (also the warm-up: compiles)
                t = timed(lambda f=fn: f(q, w, k), args.reps)
            except Exception as e:  # noqa: BLE001  (a failing variant is a row, not the end of the table)
                log.error("G=%d %s failed: %s", G, name, str(e)[:400])
                rows.append((G, name, float("nan"), "failed"))
                continue
            today = out if today is None else today
            rows.append((G, name, t, agreement(out, today)))
            log.info("G=%d %s: %.3f ms", G, name, t * 1e3)
        del q, k, w, today
    flops = lambda G: 2.0 * S * IH * G * ID  # noqa: E731
    print(f"\n{dev.device_kind}, jax {jax.__version__}: {S} queries x {IH} heads x {ID} dims; measured bf16 "
          f"matmul {rate / 1e12:.0f} TFLOP/s, HBM {bw / 1e12:.2f} TB/s (f32 scale, read + write)\n")
    print("| entries G | path | ms | vs today | agrees with today | GEMM at the matmul rate ms | % of matmul rate | "
          "products written + read at HBM rate ms |")
    print("|---|---|---|---|---|---|---|---|")
    base = {g: t for g, nm, t, _ in rows if nm.endswith("(today)")}
    for g, nm, t, same in rows:
        per = variants[nm][1]
        moved = f"{per * S * IH * g / bw * 1e3:.3f}" if per else "-"
        print(f"| {g} | {nm} | {t * 1e3:.3f} | {base[g] / t:.2f}x | {same} | {flops(g) / rate * 1e3:.3f} | "
              f"{100 * flops(g) / t / rate:.0f}% | {moved} |")


def torch_scores(q, w, k):
    """scripts/torch_baselines.py's path on the same arrays (shared through DLPack) -> its float32 scores [1, S, G]
    on the host after the GPU finished (the same blocking as the JAX rows)."""
    import torch
    import torch_baselines as tb

    s = tb.index_scores(*(torch.from_dlpack(a[0]) for a in (q, w, k)))
    torch.cuda.synchronize()
    return s[None].cpu().numpy()


def agreement(out, today) -> str:
    """'bit-equal', or the fraction of scores equal and the largest difference in bf16 steps of today's value."""
    if np.array_equal(out, today):
        return "bit-equal"
    step = np.abs(today) * 2.0 ** -7 + 1e-30
    return f"{np.mean(out == today):.4f} equal, max {np.max(np.abs(out - today) / step):.2f} steps"


if __name__ == "__main__":
    main()
