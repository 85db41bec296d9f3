"""The two-level sparse indexer (spec §2.4): ReLU-weighted MQA logits over compressed positions, layer 20's
block-level candidate pool, and the top-k that picks which compressed entries each query attends to."""

from __future__ import annotations

import math

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
    blk = block_maxima(s, bs)
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


# ------------------------------------------------------------------------------------------------------------------
# The same selections over a row given block by block (the engine: only the blocks some query sees are scored)
# ------------------------------------------------------------------------------------------------------------------


def lax_positions(s: jax.Array, k: int) -> jax.Array:
    """The positions of s's top k by lax.top_k (a sort; ties to the lower position)."""
    return jax.lax.top_k(s, k)[1]


def block_pages(pages: int, entries_per_page: int, entries: int, min_entries: int, multiple: int = 1) -> int:
    """Pages of one block of `running_topk` over a block table `pages` wide: about `entries` entries, at least
    min_entries, a whole number of `multiple` entries, at most the table (rounded up to that multiple)."""
    E = entries_per_page
    step = multiple // math.gcd(E, multiple)  # pages that hold a whole number of `multiple` entries
    bp = max(entries // E, -(-min_entries // E), 1)
    return min(-(-bp // step) * step, -(-pages // step) * step)


def running_topk(scores_of, num_blocks: int, live: jax.Array, k: int, select=lax_positions,
                 block_size: int = 0) -> tuple[jax.Array, jax.Array | None]:
    """`select_topk`'s entries of a row of num_blocks * W scores given W at a time: scores_of(i) (i traced) ->
    float32 [B, S, W], the scores of entries [i W, (i + 1) W). Only blocks i < live are scored (live: traced, a
    run-time trip count, 1 <= live <= num_blocks); the blocks past it must hold only -inf, which one top_k over
    the row would pick only after block 0's (W >= k). Each block merges into the k kept: select over the kept
    followed by the block, the kept first with the lower ids, so ties go to the lower id as in one top_k.
    select(s, k) -> int32 [..., k]: the positions lax.top_k(s, k) picks, in any order.
    -> (entry ids int32 [B, S, k], unordered; with block_size, the maxima of each block_size entries float32
    [B, S, num_blocks * W / block_size], -inf past live; else None)."""
    s0 = scores_of(0)
    W = s0.shape[-1]
    if W < k:
        raise ValueError(f"blocks of {W} entries cannot hold the top {k}")

    def merge(i, state):
        v, ids, mx = state
        s = scores_of(i)
        if block_size:
            mx = jax.lax.dynamic_update_slice_in_dim(mx, block_maxima(s, block_size), i * (W // block_size), axis=2)
        vs = jnp.concatenate([v, s], -1)
        at = select(vs, k)
        new = jnp.broadcast_to(i * W + jnp.arange(W, dtype=jnp.int32), s.shape)
        return jnp.take_along_axis(vs, at, -1), jnp.take_along_axis(jnp.concatenate([ids, new], -1), at, -1), mx

    at0 = select(s0, k)
    mx = None
    if block_size:
        if W % block_size:
            raise ValueError(f"blocks of {W} entries are not whole blocks of {block_size}")
        mx = jnp.full((*s0.shape[:-1], num_blocks * W // block_size), -jnp.inf, jnp.float32)
        mx = jax.lax.dynamic_update_slice_in_dim(mx, block_maxima(s0, block_size), 0, axis=2)
    state = (jnp.take_along_axis(s0, at0, -1), at0.astype(jnp.int32), mx)
    _, ids, mx = jax.lax.fori_loop(1, live, merge, state)
    return ids, mx


def visible_ids(ids: jax.Array, q_pos: jax.Array, ratio: int) -> jax.Array:
    """Entry ids [B, S, k] of `running_topk` -> `select_topk`'s form: ascending, -1 where not visible."""
    ids = jnp.sort(ids, axis=-1)
    return jnp.where(ids < ((q_pos + 1) // ratio)[..., None], ids, -1).astype(jnp.int32)


def block_maxima(s: jax.Array, block_size: int) -> jax.Array:
    """Scores [..., G] -> the maximum of each block_size entries [..., ceil(G / block_size)] (-inf padded)."""
    s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, -s.shape[-1] % block_size)], constant_values=-jnp.inf)
    return jnp.max(s.reshape(*s.shape[:-1], -1, block_size), axis=-1)


def candidate_blocks(maxima: jax.Array, q_pos: jax.Array, ratio: int, cfg, select=lax_positions,
                     every_seen_first: bool = True) -> jax.Array:
    """`candidate_mask` from the block maxima [B, S, NB] (-inf where no entry is visible) as block ids: int32
    [B, S, min(candidate_topk_blocks, NB)] ascending, -1 padded; select as `running_topk`'s. cfg: names
    candidate_block_size and candidate_topk_blocks. every_seen_first: while no query sees more than
    candidate_topk_blocks blocks (Flash: 16K entries), every block a query sees is a candidate, with no top-k at
    all (the same blocks where every visible entry's score is finite, as on the pool's pages)."""
    bs, NB = cfg.candidate_block_size, maxima.shape[-1]
    kb = min(cfg.candidate_topk_blocks, NB)
    nvis = (q_pos + 1) // ratio
    seen = (nvis + bs - 1) // bs  # [B, S] blocks each query sees

    def every_seen():
        ids = jnp.arange(kb, dtype=jnp.int32)
        return jnp.where(ids < seen[..., None], ids, -1)

    def best():
        last = (nvis - 1) // bs  # the newest visible entry's block is always in (-1: none)
        blk = jnp.where(jnp.arange(NB)[None, None, :] == last[..., None], jnp.inf, maxima)
        i = select(blk, kb)
        v = jnp.take_along_axis(blk, i, axis=-1)
        big = jnp.iinfo(jnp.int32).max
        i = jnp.sort(jnp.where(v > -jnp.inf, i, big), axis=-1)
        return jnp.where(i == big, -1, i).astype(jnp.int32)

    if not every_seen_first:
        return best()
    return jax.lax.cond(jnp.max(seen) <= cfg.candidate_topk_blocks, every_seen, best)


def block_mask(blocks: jax.Array, num_blocks: int) -> jax.Array:
    """Block ids [B, S, K] (-1 = none) -> bool [B, S, num_blocks]: which blocks are listed."""
    B, S, _ = blocks.shape
    idx = jnp.where((blocks >= 0) & (blocks < num_blocks), blocks, num_blocks)  # out of range: dropped
    return jnp.zeros((B, S, num_blocks), bool).at[
        jnp.arange(B)[:, None, None], jnp.arange(S)[None, :, None], idx].set(True, mode="drop")
