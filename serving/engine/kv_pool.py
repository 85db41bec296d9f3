"""The KV pool in the serving formats (spec §4), as a pytree of device arrays: one record a layer
(`dsv41.kv_layout.LayerKV`; the pure functions that read and write it are there too).

Per KV-source layer (Flash: L2, L8, L14 at ratio 2; L20 at ratio 1), paged by token blocks:
  main KV   e2m1 packed two per byte [pages, page_entries, Dh/2] + E4M3 scale per 16 [.., Dh/16]  (288 B)
  index K   e2m1 packed [pages, page_entries, ID/2] + UE8M0 scale per 32 [.., ID/32]             (68 B)
page_entries = page_tokens / ratio. One block table per sequence slot serves every source layer.
Per layer and sequence slot, an SWA ring in FP8: e4m3 [R, Dh] + UE8M0 per 32 [R, Dh/32] (528 B a slot and layer);
R = window, and for the first decoder layer swa_replay_tokens + window (the trimmed decoder prefill reads the
windows of its swa_replay_tokens rows back from it). The pool holds one record a run of layers that share a body
(`dsv41.layer_runs`), its rings stacked [slots, n, R, ...] (slot-major, so axis 0 stays the slots a data rank
owns, and [slots * n, R, ...] is the same buffer with one ring a (slot, layer): `ring_view`); a KV source is a
run of one.
Per ratio-2 source and slot, the fp32 compressor state of an open group (kv || score). The first position each
ring may serve (bounded replay clips windows there) is request state: it travels in the batch (`Batch.ring_lo`).

With data-parallel ranks every array holds `ranks` rank-local pools stacked on its first axis (pages or slots),
which the mesh splits over the data axis: a rank's programs see their own pool, and its page and slot ids are
rank-local. The pool is replicated over tensor-parallel ranks (the one latent serves every head).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from dsv41 import layer_runs, quant, sharding
from dsv41.config import ModelConfig
from dsv41.kv_layout import LayerKV
from dsv41.sharding import Parallelism


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    """The pool: one `kv_layout.LayerKV` a run of layers (`dsv41.layer_runs.runs`): its rings [S, n, R, ...]; on
a KV source (a run of one) its pages and compressor state. Every array has pages or slots on axis 0."""

    runs: list  # per run: kv_layout.LayerKV
    # speculative decoding: per DSpark stage, the ring of its context window keys (a LayerKV with only swa_q/swa_s);
    # per slot, the drafter's last states float32 [S, k, D] (the next step recomputes its draft distributions)
    dspark: list | None = None
    dspark_states: jax.Array | None = None

    def with_run(self, run: int, lkv: LayerKV) -> KVPool:
        """The pool with run `run`'s record replaced."""
        runs = list(self.runs)
        runs[run] = lkv
        return dataclasses.replace(self, runs=runs)

    def of_layer(self, cfg: ModelConfig, layer: int) -> LayerKV:
        """The record of the run holding `layer` (its rings are every layer's of the run)."""
        return self.runs[layer_runs.run_of(cfg, layer)[0]]


def ring_view(rec: LayerKV, slot: jax.Array, j) -> tuple[LayerKV, jax.Array]:
    """A run's record with its rings seen as one ring a (slot, layer) [S * n, R, ...] (a reshape: the same buffer),
    and the rows' ring ids there for the run's j-th layer (int or traced): slot * n + j, padding rows (slot == S)
    at S * n, past every ring, as the per-slot reads and writes (`kv_layout.read_slots`) expect. What the
    programs and the fused write kernel take in place of a layer's own [S, R, ...] rings."""
    S, n = rec.swa_q.shape[:2]
    flat = dataclasses.replace(rec, swa_q=rec.swa_q.reshape(S * n, *rec.swa_q.shape[2:]),
                               swa_s=rec.swa_s.reshape(S * n, *rec.swa_s.shape[2:]))
    return flat, jnp.where(slot < S, slot * n + j, S * n).astype(jnp.int32)


def fold_view(flat: LayerKV, n: int) -> LayerKV:
    """`ring_view`'s record back in the pool's layout [S, n, R, ...]."""
    return dataclasses.replace(flat, swa_q=flat.swa_q.reshape(-1, n, *flat.swa_q.shape[1:]),
                               swa_s=flat.swa_s.reshape(-1, n, *flat.swa_s.shape[1:]))


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Static shape of a pool: what the programs compile against. num_pages and num_slots are per data-parallel
    rank (a rank's programs see those); the arrays stack `ranks` of them."""

    num_pages: int
    page_tokens: int
    num_slots: int
    ranks: int = 1
    replay_tokens: int | None = None  # EngineConfig.swa_replay_tokens; None: the window
    # speculative decoding's drafts a step: every ring holds that many slots more, so that the writes of rejected
    # drafts (positions past the accepted end) land only in slots no later window reads; and the DSpark rings
    spec_tokens: int = 0

    def entries_per_page(self, ratio: int) -> int:
        return self.page_tokens // ratio


def ring_size(cfg: ModelConfig, layer: int, replay_tokens: int | None = None, spec_tokens: int = 0) -> int:
    """SWA ring slots of `layer` (layers n_layers..: the DSpark stages' context rings); the programs read it off
    the pool's shape."""
    if layer == cfg.split_layer:
        return (replay_tokens or cfg.window_size) + cfg.window_size + spec_tokens
    return cfg.window_size + spec_tokens


def abstract_pool(cfg: ModelConfig, lay: PoolLayout) -> KVPool:
    """The pool's shapes and dtypes, allocating nothing."""
    Dh, ID = cfg.head_dim, cfg.index_head_dim
    P, S = lay.num_pages * lay.ranks, lay.num_slots * lay.ranks
    sd = jax.ShapeDtypeStruct
    records = []
    for run in layer_runs.runs(cfg):
        layer = run.first  # every layer of a run has its ring size (the split layer is a run of one)
        R = ring_size(cfg, layer, lay.replay_tokens, lay.spec_tokens)
        lkv = LayerKV(sd((S, run.n, R, Dh), jnp.float8_e4m3fn), sd((S, run.n, R, Dh // 32), jnp.uint8))
        if layer in cfg.kv_source_layers:
            r = cfg.compress_ratios[layer]
            E = lay.entries_per_page(r)
            lkv = dataclasses.replace(
                lkv, kv_packed=sd((P, E, Dh // 2), jnp.uint8), kv_scale=sd((P, E, Dh // 16), jnp.float8_e4m3fn),
                ik_packed=sd((P, E, ID // 2), jnp.uint8), ik_scale=sd((P, E, ID // 32), jnp.uint8),
                # None, not an empty array, where there is no state: a zero-sized array split over data ranks
                # crashes XLA's SPMD partitioner (jaxlib 0.11.2, CPU)
                comp_state=sd((S, 2 * Dh), jnp.float32) if r > 1 else None)
        records.append(lkv)
    if not lay.spec_tokens:
        return KVPool(records)
    R = ring_size(cfg, cfg.n_layers, None, lay.spec_tokens)
    dspark = [LayerKV(sd((S, R, Dh), jnp.float8_e4m3fn), sd((S, R, Dh // 32), jnp.uint8))
              for _ in range(cfg.n_mtp_layers)]
    return KVPool(records, dspark, sd((S, lay.spec_tokens, cfg.dim), jnp.float32))


def allocate_abstract(cfg: ModelConfig, lay: PoolLayout, sharding=None) -> KVPool:
    """`allocate`'s pool as jax.ShapeDtypeStructs committed as it commits them (an abstract engine's)."""
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                                  abstract_pool(cfg, lay))


def allocate(cfg: ModelConfig, lay: PoolLayout, sharding=None) -> KVPool:
    """The pool in zeros, committed to `sharding` (default: the default device; on a mesh,
    `dsv41.sharding.rank_sharding`: split by data rank, replicated over tensor ranks).

    Committed even on one device: the engine's programs return the pool committed, and a program compiles once
    per committed / uncommitted signature of its arguments. Allocated uncommitted, the pool made each program's
    first call differ from all later ones: every prefill program compiled twice, and the program that warm-up
    ran first compiled again at the first request (tests/test_engine.py::test_warmup_leaves_nothing_to_compile)."""
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return _zeros(cfg, lay, sharding)()


@functools.lru_cache(maxsize=8)
def _zeros(cfg: ModelConfig, lay: PoolLayout, sharding) -> Callable[[], KVPool]:
    """One program that makes the whole pool (a zeros call per leaf would compile once per leaf shape)."""
    shapes = abstract_pool(cfg, lay)

    def zero_pool() -> KVPool:
        return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)

    return jax.jit(zero_pool, out_shardings=sharding)


def global_bytes_per_token(cfg: ModelConfig, lay: PoolLayout | None = None) -> float:
    """Global KV bytes one token costs, read off the pool's array layout (Flash: 890)."""
    lay = lay or PoolLayout(num_pages=1, page_tokens=64, num_slots=1)
    a = abstract_pool(cfg, lay)
    per_page = sum(x.size * x.dtype.itemsize for lkv in a.runs
                   for x in (lkv.kv_packed, lkv.kv_scale, lkv.ik_packed, lkv.ik_scale) if x is not None)
    return per_page / (lay.num_pages * lay.page_tokens)


def slot_bytes(cfg: ModelConfig) -> int:
    """Per-sequence state that does not grow with context: SWA rings and compressor state."""
    lay = PoolLayout(num_pages=1, page_tokens=64, num_slots=1)
    a = abstract_pool(cfg, lay)
    return sum(x.size * x.dtype.itemsize for lkv in a.runs for x in (lkv.swa_q, lkv.swa_s, lkv.comp_state)
               if x is not None)


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


def engram_bytes_per_device(cfg: ModelConfig, data_ranks: int) -> int:
    """The Engram tables' bytes on each device when they live in device memory (`EngineConfig.device_feed`): a data
    rank's block of each table's rows (`device_feed.split_rows`), whole on every tensor rank."""
    rows = [n for n, layer in zip(cfg.engram_num_embeddings, cfg.engram_layer_ids) if layer < cfg.n_layers]
    return sum(-(-n // data_ranks) * quant.Fp8Rows.row_bytes(cfg.engram_head_dim) for n in rows)


def capacity(cfg: ModelConfig, par: Parallelism, gpu_memory_bytes: int, max_model_len: int | None = None,
             reserve_fraction: float = 0.1, weights_dtype: str | None = None, device_feed: bool = False) -> Capacity:
    """Per-device weights from the layout's shard shapes (`sharding.weight_bytes_per_device`, abstract: no
    device needed), the pool's bytes per token and per sequence read off its arrays, and what is left on each
    device after the weights and `reserve_fraction` of its memory (activations, compiled programs). The pool is
    per data rank and replicated over its tensor ranks (one latent serves every head): tensor parallelism splits
    the weights, not the KV. device_feed: the Engram tables in device memory too, their rows split over the data
    ranks (`EngineConfig.device_feed`). Raises sharding.ParallelismError for a layout the model cannot take."""
    w = sharding.weight_bytes_per_device(cfg, par, weights_dtype)
    if device_feed:
        w += engram_bytes_per_device(cfg, par.data)
    free = gpu_memory_bytes * (1 - reserve_fraction) - w
    return Capacity(par, w, global_bytes_per_token(cfg), slot_bytes(cfg), free,
                    min(max_model_len or cfg.max_seq_len, cfg.max_seq_len))
