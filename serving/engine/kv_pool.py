"""The KV pool in the serving formats (spec §4), as a pytree of device arrays.

Per KV-source layer (Flash: L2, L8, L14 at ratio 2; L20 at ratio 1), paged by token blocks:
  main KV   e2m1 packed two per byte [pages, page_entries, Dh/2] + E4M3 scale per 16 [.., Dh/16]  (288 B)
  index K   e2m1 packed [pages, page_entries, ID/2] + UE8M0 scale per 32 [.., ID/32]             (68 B)
page_entries = page_tokens / ratio. One block table per sequence slot serves every source layer.
Per layer and sequence slot, an SWA ring in FP8: e4m3 [slots, R, Dh] + UE8M0 per 32 [slots, R, Dh/32] (528 B a
slot); R = window, and for the first decoder layer swa_replay_tokens + window (the trimmed decoder prefill
reads the windows of its swa_replay_tokens rows back from it).
Per ratio-2 source and slot, the fp32 compressor state of an open group (kv || score). The first position each
ring may serve (bounded replay clips windows there) is request state: it travels in the batch (`Batch.ring_lo`).

With data-parallel ranks every array holds `ranks` rank-local pools stacked on its first axis (pages or slots),
which the mesh splits over the data axis: a rank's programs see their own pool, and its page and slot ids are
rank-local. The pool is replicated over tensor-parallel ranks (the one latent serves every head).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dsv41 import sharding
from dsv41.config import ModelConfig
from dsv41.sharding import Parallelism


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    kv_packed: list  # per KV source: uint8 [pages, E_p, Dh/2]
    kv_scale: list  # per KV source: float8_e4m3fn [pages, E_p, Dh/16]
    ik_packed: list  # per KV source: uint8 [pages, E_p, ID/2]
    ik_scale: list  # per KV source: uint8 (UE8M0) [pages, E_p, ID/32]
    swa_q: list  # per layer: float8_e4m3fn [slots, R_l, Dh]
    swa_s: list  # per layer: uint8 (UE8M0) [slots, R_l, Dh/32]
    comp_state: list  # per KV source: float32 [slots, 2*Dh] pending kv||score (ratio 2), None (ratio 1: no state)


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Static shape of a pool: what the programs compile against. num_pages and num_slots are per data-parallel
    rank (a rank's programs see those); the arrays stack `ranks` of them."""

    num_pages: int
    page_tokens: int
    num_slots: int
    ranks: int = 1
    replay_tokens: int | None = None  # EngineConfig.swa_replay_tokens; None: the window

    def entries_per_page(self, ratio: int) -> int:
        return self.page_tokens // ratio


def ring_size(cfg: ModelConfig, layer: int, replay_tokens: int | None = None) -> int:
    """SWA ring slots of `layer`; the programs read it off the pool's shape."""
    if layer == cfg.split_layer:
        return (replay_tokens or cfg.window_size) + cfg.window_size
    return cfg.window_size


def _specs(cfg: ModelConfig, lay: PoolLayout) -> dict:
    Dh, ID = cfg.head_dim, cfg.index_head_dim
    P, S = lay.num_pages * lay.ranks, lay.num_slots * lay.ranks
    sd = jax.ShapeDtypeStruct
    out = {k: [] for k in ("kv_packed", "kv_scale", "ik_packed", "ik_scale", "comp_state", "swa_q", "swa_s")}
    for src in cfg.kv_source_layers:
        r = cfg.compress_ratios[src]
        E = lay.entries_per_page(r)
        out["kv_packed"].append(sd((P, E, Dh // 2), jnp.uint8))
        out["kv_scale"].append(sd((P, E, Dh // 16), jnp.float8_e4m3fn))
        out["ik_packed"].append(sd((P, E, ID // 2), jnp.uint8))
        out["ik_scale"].append(sd((P, E, ID // 32), jnp.uint8))
        # None, not an empty array, where there is no state: a zero-sized array split over data ranks crashes
        # XLA's SPMD partitioner (jaxlib 0.11.2, CPU)
        out["comp_state"].append(sd((S, 2 * Dh), jnp.float32) if r > 1 else None)
    for layer in range(cfg.n_layers):
        R = ring_size(cfg, layer, lay.replay_tokens)
        out["swa_q"].append(sd((S, R, Dh), jnp.float8_e4m3fn))
        out["swa_s"].append(sd((S, R, Dh // 32), jnp.uint8))
    return out


def abstract_pool(cfg: ModelConfig, lay: PoolLayout) -> KVPool:
    """The pool's shapes and dtypes, allocating nothing."""
    return KVPool(**_specs(cfg, lay))


def allocate(cfg: ModelConfig, lay: PoolLayout, sharding=None) -> KVPool:
    """The pool in zeros, committed to `sharding` (default: the default device; on a mesh,
    `dsv41.sharding.rank_sharding`: split by data rank, replicated over tensor ranks).

    Committed even on one device: the engine's programs return the pool committed, and a program compiles once
    per committed / uncommitted signature of its arguments. Allocated uncommitted, the pool made each program's
    first call differ from all later ones: every prefill program compiled twice, and the program that warm-up
    ran first compiled again at the first request (tests/test_engine.py::test_warmup_leaves_nothing_to_compile)."""
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def z(s):
        return jnp.zeros(s.shape, s.dtype, device=sharding)

    return jax.tree_util.tree_map(z, abstract_pool(cfg, lay))


def global_bytes_per_token(cfg: ModelConfig, lay: PoolLayout | None = None) -> float:
    """Global KV bytes one token costs, read off the pool's array layout (Flash: 890)."""
    lay = lay or PoolLayout(num_pages=1, page_tokens=64, num_slots=1)
    a = abstract_pool(cfg, lay)
    per_page = sum(x.size * x.dtype.itemsize for x in (*a.kv_packed, *a.kv_scale, *a.ik_packed, *a.ik_scale))
    return per_page / (lay.num_pages * lay.page_tokens)


def slot_bytes(cfg: ModelConfig) -> int:
    """Per-sequence state that does not grow with context: SWA rings and compressor state."""
    lay = PoolLayout(num_pages=1, page_tokens=64, num_slots=1)
    a = abstract_pool(cfg, lay)
    return sum(x.size * x.dtype.itemsize for x in (*a.swa_q, *a.swa_s, *filter(None, a.comp_state)))


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What one layout holds per device and in all (`capacity`)."""

    parallelism: Parallelism
    weight_bytes_per_device: int
    kv_bytes_per_token: float  # global KV; every device of a data rank holds its rank's (replicated over TP)
    slot_bytes: int  # SWA rings + compressor state of one sequence
    free_bytes_per_device: float  # for the pool, after weights and the reserve
    max_model_len: int

    @property
    def tokens_per_rank(self) -> int:
        return max(0, math.floor(self.free_bytes_per_device / self.kv_bytes_per_token))

    @property
    def tokens(self) -> int:
        return self.tokens_per_rank * self.parallelism.data

    def sessions_per_rank(self, max_len: int | None = None) -> int:
        """Sequences of max_len tokens (default max_model_len) one rank's pool holds at once."""
        per = self.kv_bytes_per_token * (max_len or self.max_model_len) + self.slot_bytes
        return max(0, math.floor(self.free_bytes_per_device / per))

    @property
    def longest_context(self) -> int:
        """The longest single sequence one rank holds (its pool for one sequence), capped by the model."""
        return max(0, min(self.max_model_len, math.floor((self.free_bytes_per_device - self.slot_bytes)
                                                         / self.kv_bytes_per_token)))


def capacity(cfg: ModelConfig, par: Parallelism, gpu_memory_bytes: int, max_model_len: int | None = None,
             reserve_fraction: float = 0.1, weights_dtype: str | None = None) -> Capacity:
    """Per-device weights from the layout's shard shapes (`sharding.weight_bytes_per_device`, abstract: no
    device needed), the pool's bytes per token and per sequence read off its arrays, and what is left on each
    device after the weights and `reserve_fraction` of its memory (activations, compiled programs). The pool is
    per data rank and replicated over its tensor ranks (one latent serves every head): tensor parallelism splits
    the weights, not the KV. Raises sharding.ParallelismError for a layout the model cannot take."""
    w = sharding.weight_bytes_per_device(cfg, par, weights_dtype)
    free = gpu_memory_bytes * (1 - reserve_fraction) - w
    return Capacity(par, w, global_bytes_per_token(cfg), slot_bytes(cfg), free,
                    min(max_model_len or cfg.max_seq_len, cfg.max_seq_len))
