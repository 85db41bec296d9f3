"""Layer-by-layer comparison of the engine's attention paths from the same state, shared by the CPU test (the
kernels' jnp references, tiny preset) and the GPU test (the compiled kernels, bench preset).

End-to-end logits are a poor check of a kernel with random weights in bf16: a 1% difference in one layer grows
chaotically through the rest (and through FP8 bins), and a different first token makes every later step differ.
Here every layer's attention is computed by both paths from the XLA path's state, so each number is that
layer's own error."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41 import engram, model, quant
from dsv41.layer_plan import Carry
from serving.engine import kv_pool, programs
from serving.engine.backends import Backends, KernelOptions


def make_batch(tokens, pos0, n_valid, slots, block_table, rows, n_layers: int):
    """A Batch whose rings serve every position (ring_lo 0 on each of n_layers)."""
    B = tokens.shape[0]
    return programs.Batch(np.asarray(tokens, np.int32), np.full(B, pos0, np.int32), np.asarray(n_valid, np.int32),
                          np.asarray(slots, np.int32), np.asarray(block_table, np.int32), np.zeros(B, np.int32),
                          np.zeros((B, n_layers), np.int32), rows)


def zero_rows(cfg, B, T):
    """Engram rows (the hashed-table lookups) as zeros: the memory adds nothing, the layer still runs."""
    shape = (B, T, cfg.engram_n_cols, cfg.engram_head_dim)
    return [quant.Fp8Rows(np.zeros(shape, ml_dtypes.float8_e4m3fn), np.zeros((*shape[:-1], shape[-1] // 32), np.uint8))
            for _ in cfg.engram_layer_ids]


def fill(core, pool, b, cfg, num):
    """Run a chunk through the XLA path (writes its KV) -> the new pool."""
    pool, _, _ = programs.run_full(core, pool, b, cfg=cfg, num=num)
    return pool


def attention_diffs(core, pool: kv_pool.KVPool, b: programs.Batch, cfg, num, backend: str,
                    opts: KernelOptions = KernelOptions()) -> np.ndarray:
    """-> [n_layers] float: per layer, max |y_backend - y_xla| over the valid tokens / max |y_xla|, both from the
    same stream and pool (the run continues on the XLA path's output and pool). opts: the kernel path's
    options."""
    return attention_diffs_each(core, pool, b, cfg, num, backend, [opts])[0]


def attention_diffs_each(core, pool: kv_pool.KVPool, b: programs.Batch, cfg, num, backend: str,
                         opts_list, with_pool: bool = False):
    """`attention_diffs` for each of several kernel-path options, in one program: each option's kernel path
    reads the same stream and pool (the XLA path's), so the results are those of one call per option, while the
    XLA path and the rest of the model are traced and compiled once (a CPU compile of the tiny preset's program
    is ~15 s). -> one [n_layers] array per option; with_pool: (those, the pool the XLA path wrote), so that a
    chunk can fill the pool for the next through the same program (one compile fewer than `fill`'s)."""
    diffs, new_pool = _both_paths(cfg, num, backend, tuple(opts_list), with_pool)(core, pool, b)
    diffs = [np.asarray(d) for d in diffs]
    return (diffs, new_pool) if with_pool else diffs


@functools.cache  # one jitted program per setting: a second chunk of the same shapes reuses its compile
def _both_paths(cfg, num, backend: str, opts_list: tuple, with_pool: bool):
    @jax.jit
    def both_paths(core, pool, b):  # params as an argument: a closure would embed them in the program
        h, pre = model.embed(core, b.tokens, cfg, num)
        freqs = model.freqs_for(cfg)
        carry_xla, carry_k = Carry(), [Carry() for _ in opts_list]
        valid = (jnp.arange(b.tokens.shape[1])[None] < b.n_valid[:, None])[..., None]  # [B, T, 1]
        diffs = [[] for _ in opts_list]
        for i, lp in enumerate(core["layers"]):
            if i in cfg.engram_layer_ids:
                h = engram.engram(h, b.rows[cfg.engram_layer_ids.index(i)], lp["engram"], cfg, num)

            def attn_fn(x, state, lp=lp, i=i):
                pool, carry_xla, carry_k = state
                # the kernel paths' pools are dropped after their attention, which read their own writes of this
                # step (the decode token's ring row); the XLA path's pool carries the run
                outs_k = [programs.cached_attention(x, lp["attn"], i, cfg, num, pool, b, carry_k[j], freqs[i],
                                                    "full", Backends(backend, opts))
                          for j, opts in enumerate(opts_list)]
                y, pool, carry_xla = programs.cached_attention(x, lp["attn"], i, cfg, num, pool, b, carry_xla,
                                                               freqs[i], "full")
                yf = y.astype(jnp.float32)
                for d, (y_k, _, _) in zip(diffs, outs_k):
                    d.append(jnp.max(jnp.abs(yf - y_k.astype(jnp.float32)) * valid) / jnp.max(jnp.abs(yf) * valid))
                return y, (pool, carry_xla, [c for _, _, c in outs_k])

            h, pre, (pool, carry_xla, carry_k) = model.block(h, pre, lp, i, cfg, num, attn_fn,
                                                             (pool, carry_xla, carry_k))
        return [jnp.stack(d) for d in diffs], (pool if with_pool else None)

    return both_paths
