"""The KV pool in the serving formats (spec §4), as a pytree of device arrays.

Per KV-source layer (Flash: L2, L8, L14 at ratio 2; L20 at ratio 1), paged by token blocks:
  main KV   e2m1 packed two per byte [pages, page_entries, Dh/2] + E4M3 scale per 16 [.., Dh/16]  (288 B)
  index K   e2m1 packed [pages, page_entries, ID/2] + UE8M0 scale per 32 [.., ID/32]             (68 B)
page_entries = page_tokens / ratio. One block table per sequence slot serves every source layer.
Per layer and sequence slot, an SWA ring in FP8: e4m3 [slots, R, Dh] + UE8M0 per 32 [slots, R, Dh/32] (528 B a
slot); R = window, and for the first decoder layer swa_replay_tokens + window (the trimmed decoder prefill
reads the windows of its swa_replay_tokens rows back from it).
Per ratio-2 source and slot, the fp32 compressor state of an open group (kv || score). `ring_lo` [L, slots]:
the first position each ring may serve (bounded replay clips windows there).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dsv41.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    kv_packed: list  # per KV source: uint8 [pages, E_p, Dh/2]
    kv_scale: list  # per KV source: float8_e4m3fn [pages, E_p, Dh/16]
    ik_packed: list  # per KV source: uint8 [pages, E_p, ID/2]
    ik_scale: list  # per KV source: uint8 (UE8M0) [pages, E_p, ID/32]
    swa_q: list  # per layer: float8_e4m3fn [slots, R_l, Dh]
    swa_s: list  # per layer: uint8 (UE8M0) [slots, R_l, Dh/32]
    comp_state: list  # per KV source (ratio 2 only, else empty [slots, 0]): float32 [slots, 2*Dh] pending kv||score
    ring_lo: jax.Array  # int32 [L, slots]


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Static shape of a pool: what the programs compile against."""

    num_pages: int
    page_tokens: int
    num_slots: int
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
    P, S = lay.num_pages, lay.num_slots
    sd = jax.ShapeDtypeStruct
    out = {k: [] for k in ("kv_packed", "kv_scale", "ik_packed", "ik_scale", "comp_state", "swa_q", "swa_s")}
    for src in cfg.kv_source_layers:
        r = cfg.compress_ratios[src]
        E = lay.entries_per_page(r)
        out["kv_packed"].append(sd((P, E, Dh // 2), jnp.uint8))
        out["kv_scale"].append(sd((P, E, Dh // 16), jnp.float8_e4m3fn))
        out["ik_packed"].append(sd((P, E, ID // 2), jnp.uint8))
        out["ik_scale"].append(sd((P, E, ID // 32), jnp.uint8))
        out["comp_state"].append(sd((S, 2 * Dh if r > 1 else 0), jnp.float32))
    for layer in range(cfg.n_layers):
        R = ring_size(cfg, layer, lay.replay_tokens)
        out["swa_q"].append(sd((S, R, Dh), jnp.float8_e4m3fn))
        out["swa_s"].append(sd((S, R, Dh // 32), jnp.uint8))
    out["ring_lo"] = sd((cfg.n_layers, S), jnp.int32)
    return out


def abstract_pool(cfg: ModelConfig, lay: PoolLayout) -> KVPool:
    """The pool's shapes and dtypes, allocating nothing."""
    return KVPool(**_specs(cfg, lay))


def allocate(cfg: ModelConfig, lay: PoolLayout, sharding=None) -> KVPool:
    """The pool in zeros, committed to `sharding` (default: the default device).

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
    return sum(x.size * x.dtype.itemsize for x in (*a.swa_q, *a.swa_s, *a.comp_state)) + 4 * cfg.n_layers


def budget(cfg: ModelConfig, weight_bytes: int, gpu_memory_bytes: int, tensor_parallel: int = 1,
           max_model_len: int | None = None, reserve_fraction: float = 0.1) -> dict:
    """How many tokens and full-length sessions fit after the weights (split over tensor_parallel devices)."""
    free = gpu_memory_bytes * (1 - reserve_fraction) * tensor_parallel - weight_bytes
    per_tok = global_bytes_per_token(cfg)
    max_len = max_model_len or cfg.max_seq_len
    per_session = per_tok * max_len + slot_bytes(cfg)
    return {
        "global_kv_bytes_per_token": per_tok,
        "swa_bytes_per_session": slot_bytes(cfg),
        "free_bytes": free,
        "tokens": max(0, math.floor(free / per_tok)),
        "sessions_at_max_len": max(0, math.floor(free / per_session)),
        "max_model_len": max_len,
    }
