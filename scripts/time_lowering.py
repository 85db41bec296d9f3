"""Time tracing and lowering (Pallas -> Mosaic GPU, for sm_90a) of the engine's decode step on this machine, no
GPU needed: the bench preset (Flash's per-layer widths, 8 layers), every kernel on (KV path, FP4 expert GEMM,
mHC sites, every FP8 linear), abstract parameters. Prints one table row.

    PYTHONPATH=. python scripts/time_lowering.py --batch 64
"""

import argparse
import logging
import time

import jax
import jax.numpy as jnp

from dsv41 import model, quant
from dsv41 import params as P
from dsv41.config import preset
from serving.engine import backends, kv_pool, programs

SD = jax.ShapeDtypeStruct


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg, B = preset("bench"), args.batch
    core, _ = model.strip_tables(P.abstract_params(cfg))
    core = jax.eval_shape(backends.prepare_experts, core)
    core = jax.eval_shape(lambda c: backends.prepare_linears(c, cfg), core)
    pool = kv_pool.abstract_pool(cfg, kv_pool.PoolLayout(num_pages=64, page_tokens=64, num_slots=8))
    i = lambda *s: SD(s, jnp.int32)  # noqa: E731
    shape = (B, 1, cfg.engram_n_cols, cfg.engram_head_dim)
    rows = [quant.Fp8Rows(SD(shape, jnp.float8_e4m3fn), SD((*shape[:-1], shape[-1] // 32), jnp.uint8))
            for _ in cfg.engram_layer_ids]
    batch = programs.Batch(i(B, 1), i(B), i(B), i(B), i(B, 8), i(B), rows)
    samp = programs.Sampling(SD((B,), jnp.float32), SD((B,), jnp.float32), SD((B,), jnp.int32),
                             SD((B, 2), jnp.uint32))
    t0 = time.perf_counter()
    be = backends.Backends("pallas", ops=backends.kernel_ops(experts=True, linears=True, mhc="pallas"))
    traced = programs.run_full.trace(core, pool, batch, samp, cfg=cfg, num=quant.REFERENCE, backends=be)
    t1 = time.perf_counter()
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    t2 = time.perf_counter()
    print("| preset | layers | batch | trace s | lower s | mosaic_gpu mentions in the module | module MB |")
    print("|---|---|---|---|---|---|---|")
    print(f"| bench | {cfg.n_layers} | {B} | {t1 - t0:.1f} | {t2 - t1:.1f} | {text.count('mosaic_gpu')} | "
          f"{len(text) / 1e6:.1f} |")


if __name__ == "__main__":
    main()
