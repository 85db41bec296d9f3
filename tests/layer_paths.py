"""Layer-by-layer comparison of the engine's attention paths from the same state, shared by the CPU test (the
kernels' jnp references, tiny preset) and the GPU test (the compiled kernels, bench preset).

End-to-end logits are a poor check of a kernel with random weights in bf16: a 1% difference in one layer grows
chaotically through the rest (and through FP8 bins), and a different first token makes every later step differ.
Here every layer's attention is computed by both paths from the XLA path's state, so each number is that
layer's own error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41 import engram, model, quant
from serving.engine import kv_pool, programs


def make_batch(tokens, pos0, n_valid, slots, block_table, rows):
    B = tokens.shape[0]
    return programs.Batch(np.asarray(tokens, np.int32), np.full(B, pos0, np.int32), np.asarray(n_valid, np.int32),
                          np.asarray(slots, np.int32), np.asarray(block_table, np.int32), np.zeros(B, np.int32),
                          rows)


def zero_rows(cfg, B, T):
    """Engram rows (the hashed-table lookups) as zeros: the memory adds nothing, the layer still runs."""
    shape = (B, T, cfg.engram_n_cols, cfg.engram_head_dim)
    return [quant.Fp8Rows(np.zeros(shape, ml_dtypes.float8_e4m3fn), np.zeros((*shape[:-1], shape[-1] // 32), np.uint8))
            for _ in cfg.engram_layer_ids]


def fill(core, pool, b, cfg, num):
    """Run a chunk through the XLA path (writes its KV) -> the new pool."""
    B = b.tokens.shape[0]
    samp = programs.Sampling(np.zeros(B, np.float32), np.ones(B, np.float32), np.zeros(B, np.int32),
                             np.zeros((B, 2), np.uint32))
    pool, _, _ = programs.run_full(core, pool, b, samp, cfg=cfg, num=num)
    return pool


def attention_diffs(core, pool: kv_pool.KVPool, b: programs.Batch, cfg, num, backend: str,
                    opts: programs.KernelOptions = programs.KernelOptions()) -> np.ndarray:
    """-> [n_layers] float: per layer, max |y_backend - y_xla| over the valid tokens / max |y_xla|, both from the
    same stream and pool (the run continues on the XLA path's output and pool). opts: the kernel path's
    options."""

    @jax.jit
    def both_paths(core, pool, b):  # params as an argument: a closure would embed them in the program
        h, pre = model.embed(core, b.tokens, cfg, num)
        freqs = model.freqs_for(cfg)
        shared = {"xla": {}, backend: {}}
        valid = (jnp.arange(b.tokens.shape[1])[None] < b.n_valid[:, None])[..., None]  # [B, T, 1]
        diffs = []
        for i, lp in enumerate(core["layers"]):
            if i in cfg.engram_layer_ids:
                h = engram.engram(h, b.rows[cfg.engram_layer_ids.index(i)], lp["engram"], cfg, num)

            def attn_fn(x, lp=lp, i=i):
                nonlocal pool
                # the kernel path's pool is dropped after its attention, which read its own writes of this step
                # (the decode token's ring row); the XLA path's pool carries the run
                y_k, _ = programs.cached_attention(x, lp["attn"], i, cfg, num, pool, b, shared[backend], freqs[i],
                                                   "full", backend, opts)
                y, pool = programs.cached_attention(x, lp["attn"], i, cfg, num, pool, b, shared["xla"], freqs[i],
                                                    "full", "xla")
                yf, kf = y.astype(jnp.float32), y_k.astype(jnp.float32)
                diffs.append(jnp.max(jnp.abs(yf - kf) * valid) / jnp.max(jnp.abs(yf) * valid))
                return y

            h, pre = model.block(h, pre, lp, i, cfg, num, attn_fn)
        return jnp.stack(diffs)

    return np.asarray(both_paths(core, pool, b))
