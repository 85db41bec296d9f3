"""The serving KV pool's layout (spec §4): one layer's record of pool arrays (`LayerKV`), and pure functions over
arrays: entry ids to pool pages through a block table, entry writes and reads, the per-slot SWA rings (writes,
and the position each slot holds) and the compressor's step over a chunk with its pending state. The engine's
programs (serving/engine/programs.py) and the fused write kernel's reference (pallas_kernels/kv_write.py) both
write the pool through these, so the two agree byte for byte by construction.

Shapes: B rows, T tokens a row, pages P of E entries, slots S, rings of R positions, C block-table columns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv41 import compressor
from dsv41.attention import NO_POS
from dsv41.nn import rms_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One layer's arrays of the KV pool (serving/engine/kv_pool.py), also the fused write kernel's operand
    (pallas_kernels/kv_write.py). Every layer has its SWA ring; a KV source also its compressed-KV and index-key
    pages and, at ratio 2, the open group's pending state. Entry arrays are None on other layers (they read their
    source's: `layer_plan.LayerPlan.kv_source`), comp_state None unless ratio 2: None, not an empty array, as a
    zero-sized array split over data ranks crashes XLA's SPMD partitioner (jaxlib 0.11.2, CPU).

    swa_q float8_e4m3fn [S, R, Dh]; swa_s uint8 (UE8M0) [S, R, Dh/32];
    kv_packed uint8 (e2m1 pairs) [P, E, Dh/2]; kv_scale float8_e4m3fn [P, E, Dh/16];
    ik_packed uint8 [P, E, ID/2]; ik_scale uint8 (UE8M0) [P, E, ID/32]; comp_state float32 [S, 2*Dh] (kv || score)."""

    swa_q: jax.Array
    swa_s: jax.Array
    kv_packed: jax.Array | None = None
    kv_scale: jax.Array | None = None
    ik_packed: jax.Array | None = None
    ik_scale: jax.Array | None = None
    comp_state: jax.Array | None = None


def page_index(block_table: jax.Array, g: jax.Array, E: int) -> tuple[jax.Array, jax.Array]:
    """Entry ids g [B, ...] -> (page [B, ...], offset in the page) through block_table [B, C]."""
    col = jnp.clip(g // E, 0, block_table.shape[1] - 1)
    page = jnp.take_along_axis(block_table, col.reshape(col.shape[0], -1), axis=1).reshape(g.shape)
    return page, g % E


def write_entries(arr: jax.Array, block_table: jax.Array, g: jax.Array, ok: jax.Array, values: jax.Array):
    """arr [P, E, ...] <- values [B, G, ...] at entry ids g [B, G] where ok [B, G] (elsewhere dropped)."""
    E = arr.shape[1]
    page, off = page_index(block_table, g, E)
    page = jnp.where(ok, page, arr.shape[0])  # out of range: dropped
    return arr.at[page, off].set(values.astype(arr.dtype), mode="drop")


def read_entries(arr: jax.Array, block_table: jax.Array, g: jax.Array) -> jax.Array:
    """arr [P, E, ...] at entry ids g [B, ...] (>= 0) -> [B, ..., ...]; zeros past the pool's pages."""
    page, off = page_index(block_table, g, arr.shape[1])
    return arr.at[page, off].get(mode="fill", fill_value=0)


def read_slots(arr: jax.Array, slot: jax.Array) -> jax.Array:
    """Per-slot state arr [S, ...] at slot [B] -> [B, ...]; padding rows (slot == S) read zeros."""
    return arr.at[slot].get(mode="fill", fill_value=0)


def write_slots(arr: jax.Array, slot: jax.Array, rows: jax.Array) -> jax.Array:
    """arr [S, ...] <- rows [B, ...] at slot [B]; padding rows (slot == S) are dropped."""
    return arr.at[slot].set(rows, mode="drop")


def write_ring(ring: jax.Array, new: jax.Array, pos0: jax.Array, n_valid: jax.Array) -> jax.Array:
    """ring [B, R, ...] <- the newest of the chunk's valid tokens new [B, T, ...] (at positions pos0 [B] + t,
    t < n_valid [B]) at slot pos % R."""
    R, T = ring.shape[1], new.shape[1]
    j = jnp.arange(R, dtype=jnp.int32)[None]
    last = pos0[:, None] + n_valid[:, None] - 1
    t = n_valid[:, None] - 1 - jnp.mod(last - j, R)  # newest chunk token landing in slot j
    ok = (t >= 0) & (n_valid[:, None] > 0)
    picked = jnp.take_along_axis(new, jnp.clip(t, 0, T - 1).reshape(*t.shape, *([1] * (new.ndim - 2))), axis=1)
    return jnp.where(ok.reshape(*ok.shape, *([1] * (new.ndim - 2))), picked, ring)


def ring_positions(end: jax.Array, R: int, lo: jax.Array) -> jax.Array:
    """Position each ring slot holds when end [B] tokens are written: slot j holds the newest p < end with
    p % R == j. -> int32 [B, R], NO_POS where empty or below lo [B]."""
    j = jnp.arange(R, dtype=jnp.int32)[None]
    last = end[:, None] - 1
    p = last - jnp.mod(last - j, R)
    return jnp.where((p >= 0) & (p >= lo[:, None]), p, NO_POS)


def compress_step(kv: jax.Array, score: jax.Array | None, state: jax.Array | None, pos0: jax.Array,
                  n_valid: jax.Array, p: dict, ratio: int, cfg, dtype):
    """The compressor over one chunk: projections kv / score [B, T, Dh] (`compressor.project`) of the tokens at
    positions pos0 [B] + t, t < n_valid [B], and for ratio 2 the open group's pending kv || score state
    [B, 2 * Dh] (float32; read where pos0 is odd). cfg: anything with norm_eps.
    -> (latents [B, G, Dh] of the groups the chunk reaches, their group ids [B, G], complete [B, G] (the group's
    last token is in the chunk), the new pending state [B, 2 * Dh] (ratio 1: `state`, unchanged))."""
    B, T, Dh = kv.shape
    if ratio == 1:
        g = pos0[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        return rms_norm(kv, p["norm"], cfg.norm_eps), g, jnp.arange(T)[None] < n_valid[:, None], state
    pend_kv, pend_sc = state[:, :Dh], state[:, Dh:]
    has = (pos0 % 2 == 1)[:, None, None]  # the chunk opens inside a group: its first token completes the pending one
    zero = jnp.zeros_like(kv[:, :1])
    ekv = jnp.where(has, jnp.concatenate([pend_kv[:, None], kv], 1), jnp.concatenate([kv, zero], 1))
    esc = jnp.where(has, jnp.concatenate([pend_sc[:, None], score], 1), jnp.concatenate([score, zero], 1))
    G = (T + 1) // 2
    ekv = ekv[:, : 2 * G].reshape(B, G, 2, Dh)
    esc = esc[:, : 2 * G].reshape(B, G, 2, Dh)
    lat = compressor.pool_groups(ekv, esc, p, cfg, dtype)
    g = (pos0 // 2)[:, None] + jnp.arange(G, dtype=jnp.int32)[None]
    complete = g < ((pos0 + n_valid) // 2)[:, None]
    end = pos0 + n_valid
    last = jnp.clip(n_valid - 1, 0, T - 1)[:, None, None]
    new_pend = jnp.concatenate([jnp.take_along_axis(kv, last, 1)[:, 0], jnp.take_along_axis(score, last, 1)[:, 0]],
                               -1)
    upd = (end % 2 == 1) & (n_valid > 0)  # the chunk ends inside a group: its last token is the new pending one
    return lat, g, complete, jnp.where(upd[:, None], new_pend, state)
