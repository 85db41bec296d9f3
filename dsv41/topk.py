"""Exact top-k by radix select, for the indexer's top-512 over thousands of scores a query.

`jax.lax.top_k` sorts (on the GPU, k = 512 of 16K scores takes 60-150 us at batch 64, more than the indexer's
scoring kernel, docs/PERFORMANCE.md). The indexer needs the set of the k best positions, in ascending order, not
the values sorted. A radix select finds the k-th largest value in a few counting passes over the scores
(4 bits a pass: 8 passes of 16 counts each), and one cumulative sum places the chosen positions in order.

Same set as lax.top_k, ties included: every position whose value beats the threshold, then the lowest positions
among those equal to it. Values are compared through an order-preserving map of the float32 bits (-inf < finite
< inf; NaN is not expected).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DIGIT_BITS = 4


def order_keys(x: jax.Array) -> jax.Array:
    """float32 [...] -> uint32 [...] with the same order: flip all bits of negatives, the sign bit of the rest."""
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    neg = (u >> 31) == 1
    return jnp.where(neg, ~u, u | jnp.uint32(0x80000000))


def kth_largest_key(keys: jax.Array, k: int) -> jax.Array:
    """uint32 [..., N] -> uint32 [...]: the k-th largest key, the largest t with #(keys >= t) >= k (1 <= k <= N).
    Most significant digit first: each pass counts, for the 16 values of the next digit, the keys at or above
    the prefix extended by it, and keeps the largest digit whose count still reaches k."""
    digits = jnp.arange(1 << DIGIT_BITS, dtype=jnp.uint32)
    prefix = jnp.zeros(keys.shape[:-1], jnp.uint32)
    for shift in range(32 - DIGIT_BITS, -1, -DIGIT_BITS):
        cand = prefix[..., None] | (digits << shift)  # [..., 16]
        counts = jnp.sum(keys[..., None, :] >= cand[..., :, None], axis=-1, dtype=jnp.int32)  # [..., 16]
        best = jnp.max(jnp.where(counts >= k, digits, 0), axis=-1)  # digit 0 always reaches k
        prefix = prefix | (best << shift)
    return prefix


def top_k_positions(x: jax.Array, k: int) -> jax.Array:
    """x float [..., N] -> int32 [..., k]: the positions lax.top_k(x, k) selects (ties to the lower position),
    in ascending order."""
    n = x.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be in [1, {n}]")
    keys = order_keys(x)
    t = kth_largest_key(keys, k)[..., None]
    above = keys > t
    need = k - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)  # how many of the ties to take
    tie = keys == t
    take = above | (tie & (jnp.cumsum(tie, axis=-1, dtype=jnp.int32) <= need))
    slot = jnp.cumsum(take, axis=-1, dtype=jnp.int32) - 1  # exactly k taken: slots 0..k-1 in position order
    lead = x.shape[:-1]
    flat_slot = jnp.where(take, slot, k).reshape(-1, n)
    rows = jnp.arange(flat_slot.shape[0])[:, None]
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), flat_slot.shape)
    out = jnp.zeros((flat_slot.shape[0], k + 1), jnp.int32).at[rows, flat_slot].set(pos, mode="drop")
    return out[:, :k].reshape(*lead, k)
