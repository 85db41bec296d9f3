"""The engine: requests in, tokens out, over the paged KV pool.

One `step()` runs at most one prefill chunk per data-parallel rank (chunked prefill, FCFS; one call for all
ranks; the chunk leaves room for the rank's decode rows within max_num_batched_tokens) and one decode step over
every running sequence. With SWA bounded replay (default) a prompt runs layers [0, split) and the split layer's
KV writes on every token (`run_encoder`, chunk by chunk), then the rest on its last `swa_replay_tokens` tokens
(`run_decoder`). A prefix cache keeps full pages of global KV; on a hit the encoder re-runs
[H - swa_replay_tokens, H) to rebuild its SWA rings and the decoder's rows without rewriting the cached KV
(encoder-side replay). Not thread-safe: drive it from one thread.

Async scheduling (`EngineConfig.async_scheduling`, off by default): a step dispatches its programs and returns
without waiting for them; the next step() first reads their sampled tokens (one device-to-host transfer, the
loop's only wait on the device), so the caller's work on the returned tokens (streaming, detokenizing) runs
while the device computes. The order of every decision is the synchronous engine's, so the tokens are the same.
The host still reads a step's tokens before it builds the next step's batch: each token's Engram rows are hashed
from it and gathered from tables in host memory (Flash's are 197 GB). With `EngineConfig.device_feed` (a GPU's
default; the tables in device memory too) the next decode step is dispatched first, its tokens fed on the device,
as vLLM's async scheduler does (device_feed.py); a speculative step's next chunk (the bonus token and the drafts)
is then built on the device from the step before (`programs.SpecFeed`). Unfed, speculative steps are synchronous.

On a device mesh (`EngineConfig.parallelism`) the programs run per data rank, each rank with its own pool,
pages, slots and prefix cache (docs/ARCHITECTURE.md, Parallelism).

Around it: config.py (EngineConfig, every option), scheduler.py (request state, admission and routing to a rank,
pages, preemption, buckets, batch arrays), prefill.py (a prompt's chunks, replay's tail, image rows),
speculative.py (DSpark's verify + draft step), device_feed.py (decode tokens fed on the device), prefix_cache.py,
sampling.py (SamplingParams, the per-row sampling arrays), programs.py (the jitted programs and the device-side
sampling).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

from dsv41 import layer_runs, model, quant, sharding
from dsv41.config import ModelConfig
from dsv41.params import VISION_KEYS
from serving.engine import backends, executables, kv_pool, precompile, programs, spec_sampling
from serving.engine import images as im
from serving.engine.config import EngineConfig
from serving.engine.device_feed import DeviceFeed
from serving.engine.errors import EngineError, QueueFull  # noqa: F401 (re-exported)
from serving.engine.kv_pool import PoolLayout
from serving.engine.prefix_cache import PrefixCache
from serving.engine.sampling import SamplingParams, sampling_arrays
from serving.engine.scheduler import (Rank, Scheduler, StepOutput, _bucket, _InFlight,  # noqa: F401 (re-exported)
                                      _Request, shared_prefill_shape)
from serving.engine.prefill import Prefill
from serving.engine.speculative import Speculative
from serving.engine.warmup import Warmup

log = logging.getLogger(__name__)


def _scatter_rows(a: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """a [sum(keep), ...] -> [len(keep), ...] with a's rows where keep, zeros elsewhere."""
    out = np.zeros((len(keep), *a.shape[1:]), a.dtype)
    out[keep] = a
    return out


def _one_row_tables(params: dict) -> dict:
    """The tree with each Engram table as one host row of zeros (an abstract engine's: the tables never reach the
    programs, and Flash's are gigabytes)."""
    layers = [{**lp, "engram": {**lp["engram"], "embed": _one_row(lp["engram"]["embed"])}} if "engram" in lp else lp
              for lp in params["layers"]]
    return {**params, "layers": layers}


def _one_row(t: quant.Fp8Rows) -> quant.Fp8Rows:
    return quant.Fp8Rows(*(np.zeros((1, *a.shape[1:]), a.dtype) for a in (t.weight, t.scale)))


def _committed(params: dict) -> dict:
    """The one-device tree committed to the default device (no copy), as a checkpoint's load leaves it and as an
    abstract engine's ShapeDtypeStructs say: every engine's programs then compile for one signature, and the
    program store's keys of drawn, loaded and abstract weights agree (`precompile`)."""
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def commit(a):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev, weak_type=a.weak_type)
        return jax.device_put(a, dev)

    return jax.tree_util.tree_map(commit, params)


def platform_config(cfg: ModelConfig, config: EngineConfig) -> EngineConfig:
    """config with device_feed decided where it is None (`EngineConfig.feeds_on_device`) for this platform, cfg's
    Engram tables and the first device's memory, before anything is placed: the engine, its compile workers (which
    get this config) and the program store's keys then see one value."""
    if config.device_feed is not None:
        return config
    stats = jax.local_devices()[0].memory_stats() or {}
    tables = kv_pool.engram_bytes_per_device(cfg, config.data_parallel_size)
    return dataclasses.replace(config, device_feed=config.feeds_on_device(jax.default_backend(), tables,
                                                                          stats.get("bytes_limit")))


class Engine(Scheduler, Prefill, Speculative, DeviceFeed, Warmup):
    def __init__(self, cfg: ModelConfig, params: dict, tokenizer, hasher, config: EngineConfig = EngineConfig(),
                 *, own_params: bool = False, abstract: bool = False,
                 compiling: precompile.CompileWorkers | None = None):
        # own_params: the caller hands `params` over (from_checkpoint, from_preset): stacking the runs of layers
        # deletes their per-layer arrays as it goes, so start-up holds the weights once, not twice.
        # abstract: params are jax.ShapeDtypeStructs (`Engine.abstract`). compiling: worker processes already
        # compiling this engine's programs into the program store (`warmup` waits for them).
        if not isinstance(config, EngineConfig):
            raise EngineError(f"config must be an EngineConfig, got {type(config).__name__}; "
                              f"pass engine options as EngineConfig(...) fields")
        config = platform_config(cfg, config)
        self.config = config
        numerics = config.numerics
        max_num_seqs, page_tokens = config.max_num_seqs, config.page_tokens
        self.cfg, self.tokenizer, self.hasher, self.num = cfg, tokenizer, hasher, numerics
        par = config.parallelism
        try:
            par.validate(cfg)
        except sharding.ParallelismError as e:
            raise EngineError(str(e)) from None
        self.mesh = sharding.make_mesh(par) if par.devices > 1 else None
        self._compiling = compiling
        if self.mesh is not None:
            params = sharding.place_params(params, cfg, par, self.mesh)
        self.params, tables = model.strip_tables(params)
        # the Engram tables go to the host (below) while the weights are prepared: gigabytes drawn on the device
        for t in tables:
            for a in (t.weight, t.scale):
                if isinstance(a, jax.Array):
                    a.copy_to_host_async()
        # the vision program's weights, apart: the text programs never read them
        self.vision_params = {k: self.params[k] for k in VISION_KEYS} if cfg.vision is not None else None
        self.params = {k: v for k, v in self.params.items() if k not in VISION_KEYS}
        try:
            self.backends, self.params = (backends.build_abstract if abstract else backends.build)(
                cfg, self.params, numerics, attention=config.attention_backend, moe_backend=config.moe_backend,
                mhc_backend=config.mhc_backend, router_backend=config.router_backend,
                linear_backend=config.linear_backend, options=config.kernel_options, parallelism=par)
        except backends.BackendError as e:
            raise EngineError(str(e)) from None
        scan = backends.scans_layers(self.backends) if config.scan_layers is None else config.scan_layers
        self.params = layer_runs.stack_params(self.params, cfg, stack=scan, consume=own_params)
        if self.mesh is None:
            self.params = _committed(self.params)
        if config.device_feed:  # before the programs take the params' shardings
            self._device_engram(abstract, tables)
        # one device: the module's programs, whose compiled cache every engine in the process shares; the
        # executables warm-up keeps (or loads from the program store) are this engine's own. Across processes the
        # programs stay with jit (a multi-process executable is neither stored nor called directly here).
        self.programs = (programs.ONE_DEVICE if self.mesh is None else
                         programs.Programs(self.mesh, jax.tree_util.tree_map(lambda a: a.sharding, self.params)))
        self.executables = (executables.Executables(executables.default_store())
                            if config.program_store and jax.process_count() == 1 else None)
        if self.executables is not None:
            self.programs = self.programs.bound(self.executables)
        # the programs' static keywords, exactly as every call passes them (jit's cache keys on them)
        self.static = {"cfg": cfg, "num": numerics, "backends": self.backends}
        self._init_speculative(cfg, config)
        # the programs of a decode step (their shapes' kinds in `program_shapes`)
        splits = config.splits_decode(jax.default_backend())
        if self.spec is None:
            split = splits and 0 < cfg.split_layer < cfg.n_layers
            self.decode_kinds = ("decode_first", "decode_rest") if split else ("decode",)
        else:
            split = splits and programs.dspark_splits(cfg)
            self.decode_kinds = ("decode_first", "spec_rest") if split else ("decode",)
        # the program an all-greedy speculative step runs in place of its last (`SpeculativeConfig.greedy_program`)
        greedy = self.spec is not None and self.spec.uses_greedy_program(jax.default_backend())
        self.greedy_kind = self.decode_kinds[-1] + "_greedy" if greedy else None
        # Engram tables are read by row on the host: keep them there (a device copy would be gathered row by row)
        # (an abstract engine with device_feed has the device tables' shapes: on the host one row of zeros)
        self.tables = [t if isinstance(t.weight, np.ndarray)
                       else _one_row(t) if abstract else quant.Fp8Rows(np.asarray(t.weight), np.asarray(t.scale))
                       for t in tables]
        # several processes: which data ranks have devices here (only their Engram rows are gathered on this host)
        self.local_ranks = None if self.mesh is None or jax.process_count() == 1 else np.array(
            [any(d.process_index == jax.process_index() for d in row) for row in self.mesh.devices])
        self.max_model_len = min(config.max_model_len or cfg.max_seq_len, cfg.max_seq_len)
        self.replay = config.swa_bounded_replay and cfg.split_layer >= 0
        if config.max_num_batched_tokens < cfg.window_size:
            raise EngineError(f"max_num_batched_tokens={config.max_num_batched_tokens} is below the model's window "
                              f"({cfg.window_size}); raise it to at least {cfg.window_size}")
        self.chunk = config.max_num_batched_tokens
        if config.swa_replay_tokens < cfg.window_size:
            raise EngineError(f"swa_replay_tokens={config.swa_replay_tokens} is below the model's window "
                              f"({cfg.window_size}): the decoder's first window would reach before its rows; "
                              f"raise it to at least {cfg.window_size}")
        self.replay_tokens = config.swa_replay_tokens
        # speculative decoding writes up to k drafts past the newest token: their pages too
        pages_per_seq = -(-(self.max_model_len + self.spec_tokens) // page_tokens)
        self.max_pages_per_seq = pages_per_seq
        self.min_prefill_bucket, min_decode = config.bucket_floors(jax.default_backend())
        self.min_decode_bucket = min(min_decode, _bucket(max_num_seqs))
        if config.batch_invariant:
            # the floors at the ceilings: every bucket (`_batch`, `decode_inputs`, `_prefill_chunk`,
            # `program_shapes`) is then the top one, so no row's program depends on the rows beside it
            self.min_prefill_bucket = self.chunk
            self.min_decode_bucket = _bucket(max_num_seqs)
        self.shared_prefill = None if config.batch_invariant else shared_prefill_shape(
            min(config.max_prefill_rows, max_num_seqs), self.chunk, self.min_prefill_bucket)
        num_pages = config.num_pages or max_num_seqs * pages_per_seq
        # per data-parallel rank, as vLLM's --max-num-seqs is per DP engine
        self.layout = PoolLayout(num_pages=num_pages, page_tokens=page_tokens, num_slots=max_num_seqs,
                                 ranks=par.data, replay_tokens=self.replay_tokens, spec_tokens=self.spec_tokens)
        self.pool = (kv_pool.allocate_abstract if abstract else kv_pool.allocate)(
            cfg, self.layout, None if self.mesh is None else sharding.rank_sharding(self.mesh))
        self.prefix_caching = self.replay if config.enable_prefix_caching is None else config.enable_prefix_caching
        self.ranks = [Rank.empty(num_pages, max_num_seqs, PrefixCache(page_tokens) if self.prefix_caching else None)
                      for _ in range(par.data)]
        self.session_rank: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.max_sessions = 1 << 16  # remembered conversation -> rank entries (LRU)
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: dict[str, _Request] = {}
        self.max_waiting = config.max_waiting
        self.eos = getattr(tokenizer, "eos_id", cfg.eos_token_id)
        self.counters = collections.Counter()
        self.keep_logits = config.keep_logits
        self.finished_logits: dict[str, list] = {}
        # unfed, a speculative step's next chunk holds its drafts, which the host needs for their Engram rows
        self.async_scheduling = config.device_feed or (config.async_scheduling and self.spec is None)
        self._init_device_feed(config.device_feed)
        if not abstract:
            log.info("decode steps: %s", (
                f"tokens fed on the device (the Engram tables in its memory too, "
                f"{kv_pool.engram_bytes_per_device(cfg, par.data) / 2**30:.1f} GiB a device; --no-device-feed: "
                f"read on the host)" if config.device_feed else
                "tokens read on the host (--device-feed: fed on the device)"))
        self._in_flight: list[_InFlight] = []  # the last step's programs, read by the next step()
        self._undelivered: list[StepOutput] = []  # outputs read by a step that then raised: the next step returns them
        # the program shapes steps may run while a staged warm-up compiles the others (`Warmup`); None: any
        self.usable_shapes: frozenset | None = None
        self._background = None  # a staged warm-up's background compiles

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str = "tiny", seed: int = 0, config: EngineConfig = EngineConfig()) -> "Engine":
        from dsv41 import params as P
        from dsv41 import tokenizer as T
        from dsv41.config import preset

        cfg = preset(name)
        config = platform_config(cfg, config)
        compiling = precompile.start(cfg, config)  # while the weights are drawn
        params = P.init_params(cfg, seed)
        return cls(cfg, params, T.load_tokenizer(), model.hasher_for(params, cfg), config, own_params=True,
                   compiling=compiling)

    @classmethod
    def abstract(cls, cfg: ModelConfig, config: EngineConfig = EngineConfig(), checkpoint: str | None = None
                 ) -> "Engine":
        """The engine `config` builds for `cfg`, over jax.ShapeDtypeStruct weights and KV pool (each Engram table one
        host row: the all-padding batches of `warmup` gather row 0 only): its programs trace, lower and compile, and
        key the program store, exactly as an allocated engine's, with nothing allocated, so a model larger than the
        device compiles too (compile workers, `scripts/bench_startup.py --abstract`); on a mesh (config's parallelism)
        each leaf is placed as the allocated engine places it, and the programs compile sharded. It cannot step.
        checkpoint: the release directory cfg comes from, whose tokenizer the Engram hasher is built from."""
        from dsv41 import checkpoint as ckpt
        from dsv41 import params as P
        from dsv41 import tokenizer as T

        tree = P.abstract_params(cfg)
        config = platform_config(cfg, config)
        if not config.device_feed:  # (fed: the device tables are program arguments: their whole shapes)
            tree = _one_row_tables(tree)
        if checkpoint is not None:
            tree = ckpt.with_token_map(tree, cfg, checkpoint)
        return cls(cfg, tree, T.load_tokenizer(checkpoint), model.hasher_for(tree, cfg), config, abstract=True)

    @classmethod
    def from_checkpoint(cls, path: str, engram_tables: str = "ram", config: EngineConfig = EngineConfig()) -> "Engine":
        """engram_tables: 'ram' reads the Engram tables into host memory at load (one sequential pass), so
        that no request's row gather waits on the disk; 'mmap' leaves them memory-mapped (less host memory,
        the first gathers of each page fault)."""
        from dsv41 import checkpoint
        from dsv41 import tokenizer as T

        if engram_tables not in checkpoint.ENGRAM_TABLE_MODES:
            raise EngineError(f"engram_tables={engram_tables!r}: choose one of {list(checkpoint.ENGRAM_TABLE_MODES)}")
        par = config.parallelism
        try:
            mesh = sharding.make_mesh(par) if par.devices > 1 else None
            # while the weights load (a release-format directory's config; an orbax one's programs compile here)
            if mesh is None and not checkpoint.is_orbax_dir(path):
                release_cfg = checkpoint.read_config(path)
                config = platform_config(release_cfg, config)
                compiling = precompile.start(release_cfg, config, checkpoint=path)
            else:
                compiling = None
            cfg, params = checkpoint.load_checkpoint(path, mesh=mesh, parallelism=par)
        except sharding.ParallelismError as e:
            raise EngineError(str(e)) from None
        if engram_tables == "ram":
            params = checkpoint.resident_tables(params)
        # the hasher from the token map load_checkpoint put in the tree: the one model.forward uses too
        return cls(cfg, params, T.load_tokenizer(path), model.hasher_for(params, cfg), config, own_params=True,
                   compiling=compiling)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids, sampling: SamplingParams = SamplingParams(),
                    session: str | None = None, replay_at: int = 0, images=()) -> None:
        """Queues a request. `replay_at` (tests, studies): compute as a prefix-cache hit of that many tokens
        would, without the cache: the global KV of [0, replay_at) is computed here, then the encoder's SWA
        is rebuilt from replay_at - window exactly as after a hit. `images`: `images.PromptImage` per image span
        of the prompt (`image_processing.expand_spans` lays the spans out)."""
        sampling.validate()
        ids = list(map(int, prompt_ids))
        if not ids:
            raise EngineError("the prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise EngineError(f"prompt of {len(ids)} tokens leaves no room within max_model_len={self.max_model_len}")
        if request_id in self.running or any(r.id == request_id for r in self.waiting):
            raise EngineError(f"request id {request_id!r} is already in use")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max {self.max_waiting})")
        if replay_at and not (self.replay and 0 < replay_at < len(ids)):
            raise EngineError(f"replay_at={replay_at} needs bounded replay and 0 < replay_at < {len(ids)}")
        images = tuple(sorted(images, key=lambda x: x.start))
        im.check(ids, images, self.cfg)
        self.waiting.append(_Request(request_id, ids, sampling, session, time.monotonic(), prefill_len=len(ids),
                                     replay_at=replay_at, images=images))

    def abort(self, request_id: str) -> None:
        for r in list(self.waiting):
            if r.id == request_id:
                self.waiting.remove(r)
                return
        r = self.running.pop(request_id, None)
        if r is not None:
            self._free(r, keep=False)

    def waiting_request_ids(self) -> list[str]:
        """The ids still in the waiting queue, oldest first (the async layer's queue-wait limit reads them)."""
        return [r.id for r in self.waiting]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight)

    def stats(self) -> dict[str, Any]:
        """Counts over the engine; the `*_per_rank` lists break them down by data-parallel rank."""
        P = self.layout.num_pages
        used = [P - len(k.free_pages) - (len(k.prefix.evictable) if k.prefix else 0) for k in self.ranks]
        running = [sum(1 for r in self.running.values() if r.rank == i) for i in range(len(self.ranks))]
        hits = [k.prefix.hit_tokens if k.prefix else 0 for k in self.ranks]
        queries = [k.prefix.query_tokens if k.prefix else 0 for k in self.ranks]
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_pages_used": sum(used),
            "kv_pages_total": P * len(self.ranks),
            "kv_page_tokens": self.layout.page_tokens,
            "prefix_cache_hit_tokens": sum(hits),
            "prefix_cache_query_tokens": sum(queries),
            "running_per_rank": running,
            "kv_pages_used_per_rank": used,
            "kv_pages_total_per_rank": [P] * len(self.ranks),
            "prefix_cache_hit_tokens_per_rank": hits,
            "prefix_cache_query_tokens_per_rank": queries,
            **({"spec_accepted_per_pos": list(self.spec_accepted_per_pos),
                "spec_verified_per_len": list(self.spec_verified_per_len)} if self.spec else {}),
            **self._warmup_stats(),
            **self.counters,
        }

    def _warmup_stats(self) -> dict[str, int]:
        """{"warmup_programs_ready", "warmup_programs"} once a warm-up started (a staged one's background compiles
        raise the first), else {}."""
        p = self.__dict__.get("_warmup_progress")
        if p is None or not p.total:
            return {}
        st = p.snapshot()
        return {"warmup_programs_ready": st["programs_ready"], "warmup_programs": st["programs"]}

    # ---- batches ------------------------------------------------------------------------------

    def _rows(self, reqs: list, toks: list[list[int]], B: int, T: int, image_mask: np.ndarray | None = None) -> list:
        """Engram rows [B, T, n_cols, d] per Engram layer for each row's valid tokens, advancing its history.
        reqs / toks: per row, a request and its tokens, or None and [] for padding. image_mask bool [B, T]: image
        tokens, which take part in no n-gram."""
        if self.hasher is None or not self.cfg.engram_layer_ids:
            return []
        rid = np.zeros((B, T, len(self.cfg.engram_layer_ids), self.cfg.engram_n_cols), np.int64)
        live = [i for i, r in enumerate(reqs) if r is not None]

        def dead(rows: list[int], n: int) -> np.ndarray | None:
            return None if image_mask is None else image_mask[rows, :n]

        if live and len({len(toks[i]) for i in live}) == 1:  # decode: every row hashes one token, in one call
            n = len(toks[live[0]])
            ids, hist = self.hasher.hash_step(np.asarray([toks[i] for i in live], np.int64),
                                              np.concatenate([reqs[i].history for i in live]), dead(live, n))
            rid[live, :n] = ids
            for j, i in enumerate(live):
                reqs[i].history = hist[j:j + 1]
        else:
            for i in live:
                n = len(toks[i])
                rid[i, :n], reqs[i].history = self.hasher.hash_step(np.asarray([toks[i]], np.int64),
                                                                    reqs[i].history, dead([i], n))
        if self.local_ranks is None:
            return model.engram_rows(self.tables, rid)
        # the other hosts' rows stay zeros: each host's devices receive only their own ranks' rows
        keep = np.repeat(self.local_ranks, B // len(self.local_ranks))
        return [quant.Fp8Rows(*(_scatter_rows(a, keep) for a in (r.weight, r.scale)))
                for r in model.engram_rows(self.tables, rid[keep])]

    def _decode_rows(self, reqs: list[_Request]) -> list[_Request | None]:
        per_rank = collections.Counter(r.rank for r in reqs)
        D = len(self.ranks)
        B, _ = self._usable("decode", D * _bucket(max(per_rank.values()), self.min_decode_bucket), self.decode_tokens)
        return self._placed(reqs, B // D)

    def _decode_batch(self, rows: list[_Request | None]) -> tuple[programs.Batch, programs.Sampling]:
        live = [r for r in rows if r is not None]
        b = self._batch(rows, {r.id: [r.last_token] for r in live}, {r.id: r.num_tokens - 1 for r in live}, 1)
        return b, self._sampling(rows)

    def decode_inputs(self, reqs: list[_Request]) -> tuple[programs.Batch, programs.Sampling]:
        """The host side of a decode step: each row's last token, padded to the batch bucket (benches time it)."""
        return self._decode_batch(self._decode_rows(reqs))

    def _sampling(self, rows: list[_Request | None]) -> programs.Sampling:
        return sampling_arrays(rows, self.cfg.vocab_size, self._fail)

    def _drawn(self, logits: jax.Array, greedy: jax.Array, samp: programs.Sampling) -> jax.Array:
        """A step's token ids: its program's argmax where no row draws, else `Programs.sample`'s, with the
        branches this step needs (the host knows them: no device-to-host read)."""
        draws, filters = spec_sampling.row_branches(samp)
        if not draws.any():
            return greedy
        return self.programs.sample(logits, samp, filtered=bool(filters.any()))

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Reads the previous step's tokens (async scheduling), admits what fits, runs one prefill call (on each
        data rank that has a prompt to fill, its oldest's next chunk, or several short prompts: `_prefill`), then
        one decode step over every running sequence. -> the tokens read in this call: with async scheduling those
        of the programs the previous call dispatched, else this call's."""
        if self._background is not None:
            self.adopt_programs()
        if self.device_feed:
            return self._fed_step()
        outs = self._undelivered = self._undelivered + self._read()
        self._admit()
        queued = self._prompts_to_fill()
        firsts = self._prefill(queued) if queued else []
        outs += firsts
        # a prompt whose first token was read in this step, or is not read yet, decodes from the next step on
        done = {o.request_id for o in firsts} | {r.id for f in self._in_flight for r in f.rows if r is not None}
        dec = [r for r in self.running.values() if not r.prefilling and r.id not in done]
        if dec:
            outs += self._decode(dec)
        self._undelivered = []
        return outs

    def _fed_step(self) -> list[StepOutput]:
        """`step` with device_feed: the decode step first (its tokens in flight fed on the device), then the
        previous step's tokens read, then admission and prefill."""
        prior, self._in_flight = self._in_flight, []
        dec = self._feed_decodes()
        outs = self._undelivered
        try:
            if dec:
                self._decode(dec)
        finally:
            outs = self._undelivered = outs + self._read(prior)
        self._admit()
        queued = self._prompts_to_fill()
        if queued:
            self._prefill(queued)
        self._undelivered = []
        return outs

    def _prompts_to_fill(self) -> dict[int, list[_Request]]:
        """Each data rank's prompts still prefilling, oldest first."""
        queued: dict[int, list[_Request]] = {}
        for r in sorted((r for r in self.running.values() if r.prefilling), key=lambda r: r.arrival):
            queued.setdefault(r.rank, []).append(r)
        return queued

    def _dispatched(self, rows: list, tok: jax.Array, logits: jax.Array, decode: bool = False) -> list[StepOutput]:
        """A program's sampled tokens: left in flight (async scheduling: -> []), or read and accepted now. decode:
        a decode step's (else a prefill call's first tokens)."""
        if self.device_feed:
            self._dispatched_fed(rows, tok, decode)
        f = _InFlight(rows, tok, logits if self.keep_logits else None)
        for a in (f.tok, f.logits):
            if a is not None:
                a.copy_to_host_async()  # queued behind the program: the read finds the ids on the host
        self._in_flight.append(f)
        return [] if self.async_scheduling else self._read()

    def _read(self, flights: list[_InFlight] | None = None) -> list[StepOutput]:
        """Reads the programs in flight (flights: those of them; None: every one; one transfer: the step's one wait
        on the device) and accepts their tokens, in the order the programs ran. A row whose request left meanwhile
        (aborted, failed, stopped while device_feed computed it one step more) is dropped; a prompt preempted
        before its first token was read takes it (`_accept_preempted`)."""
        if flights is None:
            flights, self._in_flight = self._in_flight, []
        if not flights:
            return []
        got = jax.device_get([(f.tok, f.logits) for f in flights])
        outs = []
        for f, (tok, logits) in zip(flights, got):
            if f.n_verify is not None:
                outs += self._read_spec(f.rows, tok, logits, f.n_verify)
                continue
            for i, r in enumerate(f.rows):
                if r is None:
                    continue
                running = self.running.get(r.id) is r
                if not running and not any(w is r for w in self.waiting):
                    continue
                if logits is not None:
                    r.logits.append(logits[i])
                if running and self.device_feed:
                    self._fed_read(r, int(tok[i]))
                outs += (self._accept if running else self._accept_preempted)(r, int(tok[i]))
        return outs

    def _read_spec(self, rows: list, spec: tuple, logits, n_verify: np.ndarray) -> list[StepOutput]:
        """`_read` of a fed speculative step: its rows whose requests left meanwhile dropped, the preempted ones'
        tokens taken as `_accept_preempted` takes a prompt's first."""
        rows, preempted = list(rows), set()
        for i, r in enumerate(rows):
            if r is None:
                continue
            if self.running.get(r.id) is r:
                r.in_flight -= 1
            elif any(w is r for w in self.waiting):
                preempted.add(i)
            else:
                rows[i] = None
        return self._accept_spec(rows, spec, logits, n_verify, frozenset(preempted))

    def _accept_preempted(self, r: _Request, tok: int) -> list[StepOutput]:
        """A prompt's first token, read after a decode step of the same engine step preempted the request (async
        scheduling): it recomputes from its prompt and this token, as a request preempted after reading it does."""
        r.output.append(tok)
        r.prefill_len = r.num_tokens
        reason = self._finish_reason(r, tok)
        if reason:
            self.waiting.remove(r)
            if self.keep_logits:
                self.finished_logits[r.id] = r.logits
        return [StepOutput(r.id, [tok], reason is not None, reason, len(r.prompt), r.cached)]

    def _decode(self, reqs: list[_Request]) -> list[StepOutput]:
        for r in list(reqs):
            if r.id in self.running:  # (one preempted for an earlier row is back in the queue, holding no pages)
                # speculative decoding also writes the drafts it verifies past the newest token (in flight: up to k)
                verify = self.spec_tokens if r.in_flight and self.spec is not None else self._verify_len(r)
                self._hold_pages(r, r.num_tokens + self.step_advance * r.in_flight + verify)
        reqs = [r for r in reqs if r.id in self.running]
        if not reqs:
            return []
        if self.spec is not None:
            return self._decode_speculative(reqs)
        rows = self._decode_rows(reqs)
        if self.device_feed:
            b, samp = self._fed_batch(rows), self._sampling(rows)
        else:
            b, samp = self._decode_batch(rows)
        logits, tok = self.run_decode(b)
        tok = self._drawn(logits, tok, samp)
        for r in filter(None, rows):
            r.computed = r.num_tokens + r.in_flight
        self.counters["decode_steps"] += 1
        return self._dispatched(rows, tok, logits, decode=True)

    def run_decode(self, b: programs.Batch) -> tuple[jax.Array, jax.Array]:
        """A decode step's program or programs (`decode_kinds`) on batch b, the pool updated. -> (logits [B, V],
        their argmax [B])."""
        if len(self.decode_kinds) == 2:
            self.pool, h, pre = self.programs.run_decode_first(self.params, self.pool, b, **self.static)
            self.pool, logits, tok = self.programs.run_decode_rest(self.params, self.pool,
                                                                   programs.rest_batch(b, self.cfg), h, pre,
                                                                   **self.static)
        else:
            self.pool, logits, tok = self.programs.run_full(self.params, self.pool, b, **self.static)
        return logits, tok

    def _finish_reason(self, r: _Request, tok: int) -> str | None:
        s = r.sampling
        if (tok == self.eos and not s.ignore_eos) or tok in s.stop_token_ids:
            return "stop"
        if len(r.output) >= s.max_tokens or r.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _accept(self, r: _Request, tok: int) -> list[StepOutput]:
        r.output.append(tok)
        reason = self._finish_reason(r, tok)
        if reason:
            del self.running[r.id]
            self._free(r, keep=True)
            if self.keep_logits:
                self.finished_logits[r.id] = r.logits
        return [StepOutput(r.id, [tok], reason is not None, reason, len(r.prompt), r.cached)]

    def generate(self, prompt_ids, sampling: SamplingParams = SamplingParams(), **kw) -> list[int]:
        """Runs one request to completion (a convenience for scripts and tests); kw as for add_request."""
        rid = f"gen-{time.monotonic_ns()}"
        self.add_request(rid, prompt_ids, sampling, **kw)
        out: list[int] = []
        while True:
            for o in self.step():
                if o.request_id == rid:
                    out += o.new_token_ids
                    if o.finished:
                        return out
