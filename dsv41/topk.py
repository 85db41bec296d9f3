"""Exact top-k by radix select, for the indexer's top-512 over thousands of scores a query.

`jax.lax.top_k` sorts (on the GPU, k = 512 of 16K scores takes 60-150 us at batch 64, more than the indexer's
scoring kernel, docs/PERFORMANCE.md). The indexer needs the set of the k best positions, in ascending order, not
the values sorted. A radix select finds the k-th largest value in a few counting passes over the scores
(by default 4 bits a pass: 8 passes of 16 counts each; `RADIX_VARIANTS` names wider ones), and one cumulative
sum places the chosen positions in order.

Same set as lax.top_k, ties included: every position whose value beats the threshold, then the lowest positions
among those equal to it. Values are compared through an order-preserving map of the float32 bits (-inf < finite
< inf; NaN is not expected).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIGIT_BITS = 4
# Radix variants, by the name `indexer_logits.topk_entries` takes: name -> (bits a pass, how a pass counts).
# 'compare' counts the keys at or above each candidate prefix (digits x N compares a pass); 'scatter'
# histograms the digit of the keys that share the prefix (N adds a pass) and sums it from the top. Fewer, wider
# passes trade work for launches; which wins on the GPU at each batch is measured (scripts/bench_indexer.py),
# 'radix' is the one measured so far.
RADIX_VARIANTS = {"radix": (4, "compare"), "radix8": (8, "compare"), "radix8s": (8, "scatter")}


def order_keys(x: jax.Array) -> jax.Array:
    """float32 [...] -> uint32 [...] with the same order: flip all bits of negatives, the sign bit of the rest."""
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    neg = (u >> 31) == 1
    return jnp.where(neg, ~u, u | jnp.uint32(0x80000000))


def _at_or_above(keys: jax.Array, prefix: jax.Array, shift: int, bits: int, histogram: str) -> jax.Array:
    """keys uint32 [..., N], prefix uint32 [...] (the digits above `shift` chosen, the rest 0) -> int32
    [..., 2^bits]: for each value d of the next digit, #(keys >= prefix | d << shift)."""
    digits = jnp.arange(1 << bits, dtype=jnp.uint32)
    if histogram == "compare":
        cand = prefix[..., None] | (digits << shift)
        return jnp.sum(keys[..., None, :] >= cand[..., :, None], axis=-1, dtype=jnp.int32)
    top = shift + bits  # bits at and above `top` are the chosen prefix
    high = keys & jnp.uint32(~((1 << top) - 1) & 0xFFFFFFFF) if top < 32 else jnp.zeros_like(keys)
    p = prefix[..., None]
    above = jnp.sum(high > p, axis=-1, dtype=jnp.int32)  # keys past the prefix's whole range
    digit = ((keys >> shift) & ((1 << bits) - 1)).astype(jnp.int32)
    lead, n = keys.shape[:-1], keys.shape[-1]
    rows = jnp.arange(math.prod(lead))[:, None]
    hist = jnp.zeros((math.prod(lead), 1 << bits), jnp.int32).at[rows, digit.reshape(-1, n)].add(
        (high == p).reshape(-1, n).astype(jnp.int32))
    from_top = jnp.cumsum(hist[:, ::-1], axis=-1)[:, ::-1]
    return from_top.reshape(*lead, 1 << bits) + above[..., None]


def kth_largest_key(keys: jax.Array, k: int, bits: int = DIGIT_BITS, histogram: str = "compare") -> jax.Array:
    """uint32 [..., N] -> uint32 [...]: the k-th largest key, the largest t with #(keys >= t) >= k (1 <= k <= N).
    Most significant digit first: each pass counts, for every value of the next `bits`-bit digit, the keys at or
    above the prefix extended by it, and keeps the largest digit whose count still reaches k."""
    if 32 % bits or histogram not in ("compare", "scatter"):
        raise ValueError(f"bits={bits} must divide 32 and histogram={histogram!r} be 'compare' or 'scatter'")
    digits = jnp.arange(1 << bits, dtype=jnp.uint32)
    prefix = jnp.zeros(keys.shape[:-1], jnp.uint32)
    for shift in range(32 - bits, -1, -bits):
        counts = _at_or_above(keys, prefix, shift, bits, histogram)
        best = jnp.max(jnp.where(counts >= k, digits, 0), axis=-1)  # digit 0 always reaches k
        prefix = prefix | (best << shift)
    return prefix


def top_k_positions(x: jax.Array, k: int, bits: int = DIGIT_BITS, histogram: str = "compare") -> jax.Array:
    """x float [..., N] -> int32 [..., k]: the positions lax.top_k(x, k) selects (ties to the lower position),
    in ascending order."""
    n = x.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be in [1, {n}]")
    keys = order_keys(x)
    return positions_from_threshold(keys, kth_largest_key(keys, k, bits, histogram), k)


def positions_from_threshold(keys: jax.Array, t: jax.Array, k: int) -> jax.Array:
    """keys uint32 [..., N], t uint32 [...] their k-th largest -> int32 [..., k]: every position above t and the
    lowest positions equal to it, k in all, ascending (one cumulative sum and one scatter)."""
    n = keys.shape[-1]
    t = t[..., None]
    above = keys > t
    tie = keys == t
    if n < 1 << 16:
        # One scan counts both: the keys above t in the low 16 bits, the ties in the high 16 (each count <= N).
        # The last column's low half is how many keys are above t, so no separate sum either.
        c = jnp.cumsum(above.astype(jnp.uint32) | (tie.astype(jnp.uint32) << 16), axis=-1, dtype=jnp.uint32)
        above_c, tie_c = (c & 0xFFFF).astype(jnp.int32), (c >> 16).astype(jnp.int32)
    else:
        above_c = jnp.cumsum(above, axis=-1, dtype=jnp.int32)
        tie_c = jnp.cumsum(tie, axis=-1, dtype=jnp.int32)
    need = k - above_c[..., -1:]  # how many of the ties to take
    take = above | (tie & (tie_c <= need))
    slot = above_c + jnp.minimum(tie_c, need) - 1  # exactly k taken: slots 0..k-1 in position order
    lead = keys.shape[:-1]
    flat_slot = jnp.where(take, slot, k).reshape(-1, n)
    rows = jnp.arange(flat_slot.shape[0])[:, None]
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), flat_slot.shape)
    out = jnp.zeros((flat_slot.shape[0], k + 1), jnp.int32).at[rows, flat_slot].set(pos, mode="drop")
    return out[:, :k].reshape(*lead, k)
