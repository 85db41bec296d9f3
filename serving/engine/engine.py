"""The engine: requests in, tokens out, over the paged KV pool.

One `step()` runs at most one prefill chunk per data-parallel rank (chunked prefill, FCFS; one call for all
ranks) and one decode step over every running sequence. With SWA bounded replay (default) a prompt runs layers
[0, split) and the split layer's KV writes on every token (`run_encoder`, chunk by chunk), then the rest on its
last `swa_replay_tokens` tokens (`run_decoder`). A prefix cache keeps full pages of global KV; on a hit the
encoder re-runs [H - swa_replay_tokens, H) to rebuild its SWA rings and the decoder's rows without rewriting the
cached KV (encoder-side replay). Not thread-safe: drive it from one thread.

On a device mesh (`EngineConfig.parallelism`) the programs run per data rank, each rank with its own pool,
pages, slots and prefix cache (docs/ARCHITECTURE.md, Parallelism).

Around it: config.py (EngineConfig, every option), scheduler.py (request state, admission and routing to a rank,
pages, preemption, buckets, batch arrays), prefix_cache.py, sampling.py (SamplingParams, the per-row sampling
arrays), programs.py (the jitted programs and the device-side sampling).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import model, quant, sharding
from dsv41 import vision
from dsv41.config import ModelConfig
from dsv41.params import VISION_KEYS
from serving.engine import backends, kv_pool, programs
from serving.engine import images as im
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineError, QueueFull  # noqa: F401 (re-exported)
from serving.engine.kv_pool import PoolLayout
from serving.engine.prefix_cache import PrefixCache
from serving.engine.sampling import SamplingParams, sampling_arrays
from serving.engine.scheduler import Rank, Scheduler, _bucket, _Request  # noqa: F401 (_Request: benches, tests)
from serving.engine.warmup import Warmup


def _scatter_rows(a: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """a [sum(keep), ...] -> [len(keep), ...] with a's rows where keep, zeros elsewhere."""
    out = np.zeros((len(keep), *a.shape[1:]), a.dtype)
    out[keep] = a
    return out


@dataclasses.dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


class Engine(Scheduler, Warmup):
    def __init__(self, cfg: ModelConfig, params: dict, tokenizer, hasher, config: EngineConfig = EngineConfig()):
        if not isinstance(config, EngineConfig):
            raise EngineError(f"config must be an EngineConfig, got {type(config).__name__}; "
                              f"pass engine options as EngineConfig(...) fields")
        self.config = config
        numerics = config.numerics
        max_num_seqs, page_tokens, min_ctx_pages = config.max_num_seqs, config.page_tokens, config.min_ctx_pages
        self.cfg, self.tokenizer, self.hasher, self.num = cfg, tokenizer, hasher, numerics
        par = config.parallelism
        try:
            par.validate(cfg)
        except sharding.ParallelismError as e:
            raise EngineError(str(e)) from None
        self.mesh = sharding.make_mesh(par) if par.devices > 1 else None
        if self.mesh is not None:
            params = sharding.place_params(params, cfg, par, self.mesh)
        self.params, tables = model.strip_tables(params)
        # the vision program's weights, apart: the text programs never read them
        self.vision_params = {k: self.params[k] for k in VISION_KEYS} if cfg.vision is not None else None
        self.params = {k: v for k, v in self.params.items() if k not in VISION_KEYS}
        try:
            self.backends, self.params = backends.build(
                cfg, self.params, numerics, attention=config.attention_backend, moe_backend=config.moe_backend,
                mhc_backend=config.mhc_backend, router_backend=config.router_backend,
                linear_backend=config.linear_backend, options=config.kernel_options, parallelism=par)
        except backends.BackendError as e:
            raise EngineError(str(e)) from None
        # one device: the module's programs, whose compiled cache every engine in the process shares
        self.programs = (programs.ONE_DEVICE if self.mesh is None else
                         programs.Programs(self.mesh, jax.tree_util.tree_map(lambda a: a.sharding, self.params)))
        # the programs' static keywords, exactly as every call passes them (jit's cache keys on them)
        self.static = {"cfg": cfg, "num": numerics, "backends": self.backends}
        self.spec = config.speculative_config
        if self.spec is not None:
            self._check_speculative(cfg, self.params, config)
        # a prefill under speculative decoding also seeds the DSpark rings
        self.prefill_static = self.static if self.spec is None else {**self.static, "dspark_seed": True}
        # tokens a decode row runs: 1, or the anchor and k drafts, and with ratio-2 layers one more (a speculative
        # chunk starts at an even position: `programs._spec`)
        self.spec_rerun = any(r > 1 for r in cfg.compress_ratios)
        self.decode_tokens = 1 if self.spec is None else self.spec.num_speculative_tokens + 1 + int(self.spec_rerun)
        # Engram tables are read by row on the host: keep them there (a device copy would be gathered row by row)
        self.tables = [t if isinstance(t.weight, np.ndarray)
                       else quant.Fp8Rows(np.asarray(t.weight), np.asarray(t.scale)) for t in tables]
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
        spec_k = self.spec.num_speculative_tokens if self.spec else 0
        pages_per_seq = -(-(self.max_model_len + spec_k) // page_tokens)
        self.max_pages_per_seq = pages_per_seq
        self.min_prefill_bucket, self.min_ctx_pages = config.min_prefill_bucket, min(min_ctx_pages, pages_per_seq)
        self.min_decode_bucket = min(config.min_decode_bucket, _bucket(max_num_seqs))
        if config.batch_invariant:
            # the floors at the ceilings: every bucket (`_batch`, `decode_inputs`, `_prefill_chunk`,
            # `program_shapes`) is then the top one, so no row's program depends on the rows beside it
            self.min_prefill_bucket, self.min_ctx_pages = self.chunk, pages_per_seq
            self.min_decode_bucket = _bucket(max_num_seqs)
        num_pages = config.num_pages or max_num_seqs * pages_per_seq
        # per data-parallel rank, as vLLM's --max-num-seqs is per DP engine
        self.layout = PoolLayout(num_pages=num_pages, page_tokens=page_tokens, num_slots=max_num_seqs,
                                 ranks=par.data, replay_tokens=self.replay_tokens,
                                 spec_tokens=self.spec.num_speculative_tokens if self.spec else 0)
        self.pool = kv_pool.allocate(cfg, self.layout, None if self.mesh is None else
                                     sharding.rank_sharding(self.mesh))
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
        # speculative decoding: how often the draft at each block position was accepted (vLLM's per-position count)
        self.spec_accepted_per_pos = [0] * (self.spec.num_speculative_tokens if self.spec else 0)
        self.keep_logits = config.keep_logits
        self.finished_logits: dict[str, list] = {}

    @staticmethod
    def _check_speculative(cfg: ModelConfig, params: dict, config: EngineConfig) -> None:
        k = config.speculative_config.num_speculative_tokens
        if cfg.n_mtp_layers == 0 or "mtp" not in params:
            raise EngineError("speculative decoding with DSpark needs the model's DSpark stages (mtp.*), and this "
                              "config has n_mtp_layers=0; use a checkpoint or preset with them, or leave "
                              "--speculative-config out")
        if k > cfg.dspark_block_size:
            raise EngineError(f"num_speculative_tokens={k} exceeds DSpark's block of {cfg.dspark_block_size}; "
                              f"give at most {cfg.dspark_block_size}")
        if config.swa_bounded_replay and min(cfg.dspark_target_layer_ids) < cfg.split_layer:
            raise EngineError(f"DSpark reads layers {cfg.dspark_target_layer_ids}, and under SWA bounded replay "
                              f"layers before {cfg.split_layer} never see a prompt's last tokens in one program; "
                              "use --no-swa-bounded-replay with this model")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str = "tiny", seed: int = 0, config: EngineConfig = EngineConfig()) -> "Engine":
        from dsv41 import params as P
        from dsv41 import tokenizer as T
        from dsv41.config import preset

        cfg = preset(name)
        params = P.init_params(cfg, seed)
        return cls(cfg, params, T.load_tokenizer(), model.hasher_for(params, cfg), config)

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
            cfg, params = checkpoint.load_checkpoint(path, mesh=mesh, parallelism=par)
        except sharding.ParallelismError as e:
            raise EngineError(str(e)) from None
        if engram_tables == "ram":
            params = checkpoint.resident_tables(params)
        # the hasher from the token map load_checkpoint put in the tree: the one model.forward uses too
        return cls(cfg, params, T.load_tokenizer(path), model.hasher_for(params, cfg), config)

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
        self._check_images(ids, images)
        self.waiting.append(_Request(request_id, ids, sampling, session, time.monotonic(), prefill_len=len(ids),
                                     replay_at=replay_at, images=images))

    def _check_images(self, ids: list[int], images: tuple) -> None:
        if not images:
            return
        if self.cfg.vision is None:
            raise EngineError("this model has no vision tower (its config.json has no vision_config); send text only")
        tok, end = self.cfg.image_token_id, 0
        for x in images:
            if x.start < end or x.end > len(ids) or any(t != tok for t in ids[x.start:x.end]):
                raise EngineError(f"an image span [{x.start}, {x.end}) must lie inside the prompt, overlap no other "
                                  f"span and hold only the image token {tok}; lay the prompt out with "
                                  "image_processing.expand_spans")
            if x.inputs.types.shape[0] != self.cfg.vision.max_image_tokens:
                raise EngineError("an image's inputs were prepared for another vision_config; prepare them with "
                                  "this model's config")
            end = x.end

    def _image_rows(self, chunks: list, B: int, T: int):
        """The image rows and mask of a prefill chunk (`images.chunk_rows`); each image's span rows are computed
        by the vision program when first needed and kept until its request's prefill ends."""
        by_id = {id(x): r for r in self.running.values() for x in r.images}

        def span_rows(x):
            cache = by_id[id(x)].image_rows
            if id(x) not in cache:
                i = x.inputs
                cache[id(x)] = vision.span_embeddings(self.vision_params, i.patches, i.pos, i.valid, i.merge,
                                                      i.types, cfg=self.cfg, num=self.num)
                self.counters["images_encoded"] += 1
            return cache[id(x)]

        return im.chunk_rows(chunks, span_rows, B, T, self.num.jdtype)

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
        return bool(self.waiting or self.running)

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
            **({"spec_accepted_per_pos": list(self.spec_accepted_per_pos)} if self.spec else {}),
            **self.counters,
        }

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
        return self._placed(reqs, _bucket(max(per_rank.values()), self.min_decode_bucket))

    def _decode_batch(self, rows: list[_Request | None]) -> tuple[programs.Batch, programs.Sampling]:
        live = [r for r in rows if r is not None]
        b = self._batch(rows, {r.id: [r.last_token] for r in live}, {r.id: r.num_tokens - 1 for r in live}, 1)
        return b, self._sampling(rows)

    def decode_inputs(self, reqs: list[_Request]) -> tuple[programs.Batch, programs.Sampling]:
        """The host side of a decode step: each row's last token, padded to the batch bucket (benches time it)."""
        return self._decode_batch(self._decode_rows(reqs))

    def _sampling(self, rows: list[_Request | None]) -> programs.Sampling:
        return sampling_arrays(rows, self.cfg.vocab_size, self._fail)

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Admits what fits, runs one prefill chunk on each data rank that has a prompt to fill (its oldest),
        then one decode step over every running sequence."""
        self._admit()
        outs: list[StepOutput] = []
        oldest: dict[int, _Request] = {}
        for r in self.running.values():
            if r.prefilling and (r.rank not in oldest or r.arrival < oldest[r.rank].arrival):
                oldest[r.rank] = r
        if oldest:
            for r, tok in self._prefill_chunks(sorted(oldest.values(), key=lambda r: r.rank)):
                outs += self._accept(r, tok)
        done = {o.request_id for o in outs}
        dec = [r for r in self.running.values() if not r.prefilling and r.id not in done]
        if dec:
            outs += self._decode(dec)
        return outs

    def _prefill_chunks(self, reqs: list[_Request]) -> list[tuple[_Request, int]]:
        """The next chunk of each request's prefill (one request per rank), in one call. -> (request, first
        token) for those whose prefill finished."""
        chunks, ends = {}, {}
        for r in reqs:
            end = min(r.prefill_len, r.computed + self.chunk)
            if r.replay_at and r.computed < r.replay_at:
                end = min(end, r.replay_at)
            while not self._ensure_pages(r, end):
                if not self._preempt(r):
                    self._fail(r, f"request {r.id}: the KV pool ({self.layout.num_pages} pages) cannot hold "
                                  f"{end} tokens; raise num_pages or lower max_model_len")
            chunks[r.id], ends[r.id] = r.token_range(r.computed, end), end
        T = min(self.chunk, _bucket(max(map(len, chunks.values())), self.min_prefill_bucket))
        rows = self._placed(reqs, 1)
        b = self._batch(rows, chunks, {r.id: r.computed for r in reqs}, T)
        if not self.replay:
            last = [r if r is not None and ends[r.id] == r.prefill_len else None for r in rows]
            self.pool, logits, tok = self.programs.run_full(self.params, self.pool, b, self._sampling(last),
                                                            **self.prefill_static)
            for r in reqs:
                r.computed = ends[r.id]
            return self._first_tokens(last, logits, tok)
        W = self.replay_tokens
        self.pool, h, pre = self.programs.run_encoder(self.params, self.pool, b, **self.static, replay_tokens=W)
        last: list[_Request | None] = [None] * len(rows)
        for i, r in enumerate(rows):
            if r is None:
                continue
            m = min(len(chunks[r.id]), W)  # the chunk's rows among its last W outputs (the rest are padding)
            if r.tail is None:
                r.tail = (h[i], pre[i], m)
            else:
                th, tp = programs.append_tail(r.tail[0], r.tail[1], h[i], pre[i], m)
                r.tail = (th, tp, min(r.tail[2] + m, W))
            r.computed = ends[r.id]
            if r.replay_at and r.computed == r.replay_at:
                self._restart_as_hit(r)
            elif r.computed == r.prefill_len:
                last[i] = r
        if not any(last):
            return []
        bd, hp, pp = self._decoder_inputs(last, b.block_table.shape[1])
        self.pool, logits, tok = self.programs.run_decoder(self.params, self.pool, bd, hp, pp, self._sampling(last),
                                                           **self.prefill_static)
        for r in filter(None, last):
            r.tail = None
        return self._first_tokens(last, logits, tok)

    def _decoder_inputs(self, rows: list[_Request | None], ctx_pages: int):
        """The replayed decoder's batch for the rows whose prompt is complete: each runs its last
        Td <= swa_replay_tokens rows (its tail) at positions [N - Td, N), its decoder rings clipped at N - Td."""
        B, L = len(rows), self.cfg.n_layers
        live = next(r for r in rows if r is not None)
        pad_h, pad_p = jnp.zeros_like(live.tail[0]), jnp.zeros_like(live.tail[1])
        pos0, n_valid = np.zeros(B, np.int32), np.zeros(B, np.int32)
        slot, wlo = np.full(B, self.layout.num_slots, np.int32), np.zeros(B, np.int32)
        bt, rlo = np.full((B, ctx_pages), self.layout.num_pages, np.int32), np.zeros((B, L), np.int32)
        for i, r in enumerate(rows):
            if r is None:
                continue
            Td = r.tail[2]
            r.decoder_lo = r.prefill_len - Td
            pos0[i], n_valid[i], slot[i], wlo[i] = r.prefill_len - Td, Td, r.slot, r.write_lo
            bt[i, : len(r.pages)] = r.page_row()
            rlo[i] = self._ring_lo(r)
        # fixed shapes throughout: slicing each tail to its length would compile an op per distinct length
        hp, pp = programs.left_align(jnp.stack([pad_h if r is None else r.tail[0] for r in rows]),
                                     jnp.stack([pad_p if r is None else r.tail[1] for r in rows]), n_valid)
        mask = None
        if any(r is not None and r.images for r in rows):  # bias_vl for the tail's image tokens
            mask = np.zeros(hp.shape[:2], bool)
            for i, r in enumerate(rows):
                m = None if r is None else im.mask(r.images, int(pos0[i]), r.prefill_len)
                if m is not None:
                    mask[i, : len(m)] = m
        b = programs.Batch(np.zeros((B, 1), np.int32), pos0, n_valid, slot, bt, wlo, rlo, [], None, mask)
        return b, hp, pp

    def _first_tokens(self, rows, logits, tok) -> list[tuple[_Request, int]]:
        tok = np.asarray(tok)
        out = []
        for i, r in enumerate(rows):
            if r is None:
                continue
            self.counters["prefill_tokens"] += r.prefill_len - r.start
            r.image_rows.clear()  # computed again if the request is preempted and prefilled anew
            if self.keep_logits:
                r.logits.append(np.asarray(logits[i]))
            out.append((r, int(tok[i])))
        return out

    def _restart_as_hit(self, r: _Request) -> None:
        """After [0, H) ran, continue as a prefix-cache hit of H tokens would."""
        H = r.replay_at
        r.replay_at = 0
        start = max(0, H - self.replay_tokens)
        r.write_lo, r.start, r.computed, r.tail = H, start, start, None
        r.decoder_lo = 0
        r.history = self._history_before(r, r.start)

    def _decode(self, reqs: list[_Request]) -> list[StepOutput]:
        for r in list(reqs):
            if r.id not in self.running:  # preempted for an earlier row: back in the queue, it holds no pages
                continue
            while not self._ensure_pages(r, r.num_tokens):
                if not self._preempt(r):
                    self._fail(r, f"request {r.id}: the KV pool ({self.layout.num_pages} pages) cannot hold "
                                  f"{r.num_tokens} tokens; raise num_pages or lower max_model_len")
        reqs = [r for r in reqs if r.id in self.running]
        if not reqs:
            return []
        if self.spec is not None:
            return self._decode_speculative(reqs)
        rows = self._decode_rows(reqs)
        b, samp = self._decode_batch(rows)
        self.pool, logits, tok = self.programs.run_full(self.params, self.pool, b, samp, **self.static)
        tok = np.asarray(tok)
        outs = []
        for i, r in enumerate(rows):
            if r is None:
                continue
            r.computed = r.num_tokens
            if self.keep_logits:
                r.logits.append(np.asarray(logits[i]))
            outs += self._accept(r, int(tok[i]))
        self.counters["decode_steps"] += 1
        return outs

    def _decode_speculative(self, reqs: list[_Request]) -> list[StepOutput]:
        """One speculative step (`programs._spec`): each row verifies its k drafts and takes the accepted ones and
        the target's next token; the pool already holds the next block's drafts' context. Pages cover the drafts'
        positions; what rejected drafts wrote there is overwritten by the tokens that take those positions."""
        k = self.spec.num_speculative_tokens
        for r in list(reqs):
            if r.id in self.running:
                while not self._ensure_pages(r, r.num_tokens + k):
                    if not self._preempt(r):
                        self._fail(r, f"request {r.id}: the KV pool ({self.layout.num_pages} pages) cannot hold "
                                      f"{r.num_tokens + k} tokens; raise num_pages or lower max_model_len")
        reqs = [r for r in reqs if r.id in self.running]
        if not reqs:
            return []
        rows = self._decode_rows(reqs)
        toks, pos0 = {}, {}
        for r in filter(None, rows):
            a = r.num_tokens - 1  # the anchor: the newest token, whose KV is not in the pool yet
            # a chunk starts at an even position (`programs._spec`): an odd anchor re-runs the token before it
            back = 1 if self.spec_rerun and a % 2 else 0
            drafts = (r.drafts + [self.cfg.dspark_noise_token_id] * k)[:k]
            toks[r.id] = r.token_range(a - back, a + 1) + drafts
            pos0[r.id] = a - back
            r.history = self._history_before(r, a - back)
        b = self._batch(rows, toks, pos0, self.decode_tokens)
        samp = self._sampling(rows)
        # a row's drafts came from the drafter's last step (whose states the pool holds), or not (after a prefill)
        has_q = np.asarray([r is not None and r.drafts_drawn for r in rows])
        self.pool, logits, out, acc, nxt = self.programs.run_spec(
            self.params, self.pool, b, samp, has_q, np.full(len(rows), self.spec.forced_acceptance), **self.static,
            spec_tokens=k)
        out, acc, nxt = np.asarray(out), np.asarray(acc), np.asarray(nxt)
        outs = []
        for i, r in enumerate(rows):
            if r is None:
                continue
            a = r.num_tokens - 1
            new: list[int] = []
            for j in range(int(acc[i]) + 1):
                r.computed = a + j + 1  # the pool holds the anchor and the j drafts accepted before this token
                if self.keep_logits:
                    r.logits.append(np.asarray(logits[i, j]))
                o = self._accept(r, int(out[i, j]))[0]
                new.append(int(out[i, j]))
                if o.finished:
                    break
            r.drafts, r.drafts_drawn = nxt[i].tolist(), True
            self.counters["spec_drafts"] += 1
            self.counters["spec_draft_tokens"] += k
            self.counters["spec_accepted_tokens"] += len(new) - 1
            for j in range(len(new) - 1):
                self.spec_accepted_per_pos[j] += 1
            outs.append(dataclasses.replace(o, new_token_ids=new))
        self.counters["decode_steps"] += 1
        return outs

    def _accept(self, r: _Request, tok: int) -> list[StepOutput]:
        r.output.append(tok)
        s = r.sampling
        reason = None
        if (tok == self.eos and not s.ignore_eos) or tok in s.stop_token_ids:
            reason = "stop"
        elif len(r.output) >= s.max_tokens or r.num_tokens >= self.max_model_len:
            reason = "length"
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
