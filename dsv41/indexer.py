"""The two-level sparse indexer (spec §2.4): ReLU-weighted MQA logits over compressed positions, layer 20's
block-level candidate pool, and the top-k that picks which compressed entries each query attends to."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import quant
from dsv41.config import ModelConfig
from dsv41.nn import linear, rms_norm
from dsv41.quant import Numerics
from dsv41.rope import apply_rope


def index_keys(latent: jax.Array, p: dict, pos: jax.Array, freqs: np.ndarray, cfg: ModelConfig,
               num: Numerics) -> jax.Array:
    """Pre-RoPE latents [B, G, Dh] at positions pos [B, G] (group start) -> index keys [B, G, index_head_dim]."""
    k = rms_norm(linear(latent, p["wk"], num, fp8_input=False), p["k_norm"], cfg.norm_eps)
    k = apply_rope(k, pos, freqs)
    return quant.mxfp4_qdq(k) if num.kv_quant else k


def index_queries(x: jax.Array, qr: jax.Array, p: dict, pos: jax.Array, freqs: np.ndarray, cfg: ModelConfig,
                  num: Numerics, ops=None):
    """-> queries [B, S, IH, ID] and head weights [B, S, IH]. ops: the `dsv41.ops.Ops` whose linears run here
    (None: `nn`'s XLA ones)."""
    IH, ID = cfg.index_n_heads, cfg.index_head_dim
    q = (linear if ops is None else ops.linear)(qr, p["wq_b"], num, fp8_input=True).reshape(*qr.shape[:-1], IH, ID)
    q = apply_rope(q, pos[..., None], freqs)
    if num.kv_quant:
        q = quant.mxfp4_qdq(q)
    w = linear(x, p["weights_proj"], num, fp8_input=False)
    w = (w.astype(jnp.float32) * (ID**-0.5 * IH**-0.5)).astype(num.jdtype)
    return q, w


# The [B, S, heads, G] float32 products before the head sum grow with the context at a long prefill (2048 queries
# x 16K entries x 32 heads: 4 GiB if written out; 32 GiB at 128K). Past 4 GiB (beyond 16K entries at such a
# chunk: nothing measured so far changes) the entries go in blocks, one after another; each score is the same
# arithmetic as in one pass (its head sum is its own), up to the float32 summation order XLA picks for the dot.
MAX_PRODUCT_BYTES = 4 << 30


def raw_scores(q: jax.Array, w: jax.Array, k: jax.Array, dtype, products_in_dtype: bool = False) -> jax.Array:
    """score(i, g) = sum_h w_h relu(q_h . k_g), each step rounded to `dtype` as the reference does (bf16 scores
    make exact ties common). q [B, S, IH, ID], w [B, S, IH], k [B, G, ID] -> float32 [B, S, G].
    products_in_dtype: the q.k GEMM writes its products in `dtype` (its float32 accumulator rounded once as it
    is stored, the same rounding) instead of float32 rounded by the next op: half the bytes of the largest
    intermediate at bf16 (scripts/bench_index_scores.py times the two on the GPU)."""
    B, S, IH, ID = q.shape
    G = k.shape[1]
    item = jnp.dtype(dtype).itemsize if products_in_dtype else 4
    blk = max(128, MAX_PRODUCT_BYTES // (item * B * S * IH) // 128 * 128)
    if blk >= G:
        return _raw_scores(q, w, k, dtype, products_in_dtype)
    n = -(-G // blk)
    kb = jnp.pad(k, ((0, 0), (0, n * blk - G), (0, 0))).reshape(B, n, blk, ID).swapaxes(0, 1)
    s = jax.lax.map(lambda kk: _raw_scores(q, w, kk, dtype, products_in_dtype), kb)  # [n, B, S, blk]
    return jnp.moveaxis(s, 0, 2).reshape(B, S, n * blk)[..., :G]


def _raw_scores(q: jax.Array, w: jax.Array, k: jax.Array, dtype, products_in_dtype: bool) -> jax.Array:
    prod = jnp.einsum("bshd,btd->bsht", q.astype(dtype), k.astype(dtype),
                      preferred_element_type=dtype if products_in_dtype else jnp.float32)
    s = quant.round_to(prod.astype(jnp.float32), dtype)  # (a no-op on products already in dtype)
    # a dtype x dtype product is exact in float32: one rounding after it is the dtype multiply
    s = quant.round_to(jax.nn.relu(s) * quant.round_to(w[..., None].astype(jnp.float32), dtype), dtype)
    return quant.round_to(jnp.sum(s, axis=2), dtype)


def scores(q: jax.Array, w: jax.Array, k: jax.Array, q_pos: jax.Array, ratio: int, num: Numerics) -> jax.Array:
    """`raw_scores` in the activation dtype, -inf where group g is not complete for query i.
    q [B, S, IH, ID], w [B, S, IH], k [B, G, ID], q_pos [B, S] -> float32 [B, S, G]."""
    s = raw_scores(q, w, k, num.jdtype)
    G = k.shape[1]
    visible = jnp.arange(G)[None, None, :] < ((q_pos + 1) // ratio)[..., None]
    return jnp.where(visible, s, -jnp.inf)


def candidate_mask(s: jax.Array, q_pos: jax.Array, ratio: int, cfg: ModelConfig) -> jax.Array:
    """Level one (layer 20): keep each query's best `candidate_topk_blocks` blocks of `candidate_block_size`
    positions, the block holding its newest visible position always in. s [B, S, G] -> bool [B, S, G]."""
    bs = cfg.candidate_block_size
    G = s.shape[-1]
    pad = -G % bs
    blk = jnp.pad(s, [(0, 0), (0, 0), (0, pad)], constant_values=-jnp.inf)
    blk = jnp.max(blk.reshape(*s.shape[:-1], -1, bs), axis=-1)
    nb = blk.shape[-1]
    last = ((q_pos + 1) // ratio - 1) // bs  # -1 (no block) when nothing is visible yet
    blk = jnp.where(jnp.arange(nb)[None, None, :] == last[..., None], jnp.inf, blk)
    kb = min(cfg.candidate_topk_blocks, nb)
    top_v, top_i = jax.lax.top_k(blk, kb)
    keep = jnp.zeros(blk.shape, bool)
    keep = jax.vmap(jax.vmap(lambda k, i, v: k.at[i].set(v > -jnp.inf)))(keep, top_i, top_v)
    return jnp.repeat(keep, bs, axis=-1)[..., :G]


def select_topk(s: jax.Array, q_pos: jax.Array, ratio: int, cfg: ModelConfig) -> jax.Array:
    """s [B, S, G] -> int32 [B, S, min(index_topk, G)] group ids in ascending order; -1 where not visible.
    Ties go to the lower id."""
    G = s.shape[-1]
    k = min(cfg.index_topk, G)
    if k == 0:
        return jnp.zeros((*s.shape[:-1], 0), jnp.int32)
    _, idx = jax.lax.top_k(s, k)
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx < ((q_pos + 1) // ratio)[..., None], idx, -1).astype(jnp.int32)
