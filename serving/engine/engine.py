"""The engine: requests in, tokens out, over the paged KV pool.

One `step()` runs at most one prefill chunk (chunked prefill, FCFS) and one decode step over every running
sequence. With SWA bounded replay (default) a prompt runs layers [0, split) and the split layer's KV writes on
every token (`run_encoder`, chunk by chunk), then the rest on its last `swa_replay_tokens` tokens
(`run_decoder`). A prefix cache keeps full pages of global KV; on a hit the encoder re-runs
[H - swa_replay_tokens, H) to rebuild its SWA rings and the decoder's rows without rewriting the cached KV
(encoder-side replay). Not thread-safe: drive it from one thread.

Around it: config.py (EngineConfig, every option), scheduler.py (request state, admission, pages, preemption,
buckets, batch arrays), prefix_cache.py, sampling.py (SamplingParams, the per-row sampling arrays), programs.py
(the jitted programs and the device-side sampling).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import model, quant
from dsv41.config import ModelConfig
from serving.engine import backends, kv_pool, programs
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineError, QueueFull  # noqa: F401 (re-exported)
from serving.engine.kv_pool import PoolLayout
from serving.engine.prefix_cache import PrefixCache
from serving.engine.sampling import SamplingParams, sampling_arrays
from serving.engine.scheduler import Scheduler, _bucket, _Request  # noqa: F401 (_Request: benches, tests)
from serving.engine.warmup import Warmup


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
        # as locals: the backend and weight-preparation lines below read them by these names
        numerics = config.numerics
        max_num_seqs, page_tokens, min_ctx_pages = config.max_num_seqs, config.page_tokens, config.min_ctx_pages
        self.cfg, self.tokenizer, self.hasher, self.num = cfg, tokenizer, hasher, numerics
        self.params, tables = model.strip_tables(params)
        try:
            self.backends, self.params = backends.build(
                cfg, self.params, numerics, attention=config.attention_backend, moe_backend=config.moe_backend,
                mhc_backend=config.mhc_backend, router_backend=config.router_backend,
                linear_backend=config.linear_backend, options=config.kernel_options)
        except backends.BackendError as e:
            raise EngineError(str(e)) from None
        # the programs' static keywords, exactly as every call passes them (jit's cache keys on them)
        self.static = {"cfg": cfg, "num": numerics, "backends": self.backends}
        # Engram tables are read by row on the host: keep them there (a device copy would be gathered row by row)
        self.tables = [t if isinstance(t.weight, np.ndarray)
                       else quant.Fp8Rows(np.asarray(t.weight), np.asarray(t.scale)) for t in tables]
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
        pages_per_seq = -(-self.max_model_len // page_tokens)
        self.max_pages_per_seq = pages_per_seq
        self.min_prefill_bucket, self.min_ctx_pages = config.min_prefill_bucket, min(min_ctx_pages, pages_per_seq)
        self.min_decode_bucket = min(config.min_decode_bucket, _bucket(max_num_seqs))
        num_pages = config.num_pages or max_num_seqs * pages_per_seq
        self.layout = PoolLayout(num_pages=num_pages, page_tokens=page_tokens, num_slots=max_num_seqs,
                                 replay_tokens=self.replay_tokens)
        self.pool = kv_pool.allocate(cfg, self.layout)
        self.free_pages = collections.deque(range(num_pages))
        self.free_slots = collections.deque(range(max_num_seqs))
        self.prefix = PrefixCache(page_tokens) if (self.replay if config.enable_prefix_caching is None
                                                   else config.enable_prefix_caching) else None
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: dict[str, _Request] = {}
        self.max_waiting = config.max_waiting
        self.eos = getattr(tokenizer, "eos_id", cfg.eos_token_id)
        self.counters = collections.Counter()
        self.keep_logits = config.keep_logits
        self.finished_logits: dict[str, list] = {}

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str = "tiny", seed: int = 0, config: EngineConfig = EngineConfig()) -> "Engine":
        from dsv41 import params as P
        from dsv41 import tokenizer as T
        from dsv41.config import preset

        cfg = preset(name)
        return cls(cfg, P.init_params(cfg, seed), T.load_tokenizer(), model.builtin_hasher(cfg), config)

    @classmethod
    def from_checkpoint(cls, path: str, engram_tables: str = "ram", config: EngineConfig = EngineConfig()) -> "Engine":
        """engram_tables: 'ram' reads the Engram tables into host memory at load (one sequential pass), so
        that no request's row gather waits on the disk; 'mmap' leaves them memory-mapped (less host memory,
        the first gathers of each page fault)."""
        from dsv41 import checkpoint, ngram_hash
        from dsv41 import tokenizer as T

        if engram_tables not in checkpoint.ENGRAM_TABLE_MODES:
            raise EngineError(f"engram_tables={engram_tables!r}: choose one of {list(checkpoint.ENGRAM_TABLE_MODES)}")
        cfg, params = checkpoint.load_checkpoint(path)
        if engram_tables == "ram":
            params = checkpoint.resident_tables(params)
        tok = T.load_tokenizer(path)
        hasher = ngram_hash.NgramHasher(cfg, T.build_compressed_token_map(tok)[0]) if cfg.engram_layer_ids else None
        return cls(cfg, params, tok, hasher, config)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids, sampling: SamplingParams = SamplingParams(),
                    session: str | None = None, replay_at: int = 0) -> None:
        """Queues a request. `replay_at` (tests, studies): compute as a prefix-cache hit of that many tokens
        would, without the cache: the global KV of [0, replay_at) is computed here, then the encoder's SWA
        is rebuilt from replay_at - window exactly as after a hit."""
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
        self.waiting.append(_Request(request_id, ids, sampling, session, time.monotonic(), prefill_len=len(ids),
                                     replay_at=replay_at))

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
        used = self.layout.num_pages - len(self.free_pages) - (len(self.prefix.evictable) if self.prefix else 0)
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_pages_used": used,
            "kv_pages_total": self.layout.num_pages,
            "kv_page_tokens": self.layout.page_tokens,
            "prefix_cache_hit_tokens": self.prefix.hit_tokens if self.prefix else 0,
            "prefix_cache_query_tokens": self.prefix.query_tokens if self.prefix else 0,
            **self.counters,
        }

    # ---- batches ------------------------------------------------------------------------------

    def _rows(self, reqs: list[_Request], toks: list[list[int]], B: int, T: int) -> list:
        """Engram rows [B, T, n_cols, d] per Engram layer for each row's valid tokens, advancing its history."""
        if self.hasher is None or not self.cfg.engram_layer_ids:
            return []
        rid = np.zeros((B, T, len(self.cfg.engram_layer_ids), self.cfg.engram_n_cols), np.int64)
        if len({len(t) for t in toks}) == 1:  # decode: every row hashes one token, in one call
            n = len(reqs)
            rid[:n, : len(toks[0])], hist = self.hasher.hash_step(np.asarray(toks, np.int64),
                                                                  np.concatenate([r.history for r in reqs]))
            for i, r in enumerate(reqs):
                r.history = hist[i:i + 1]
        else:
            for i, (r, t) in enumerate(zip(reqs, toks)):
                rid[i, : len(t)], r.history = self.hasher.hash_step(np.asarray([t], np.int64), r.history)
        return model.engram_rows(self.tables, rid)

    def decode_inputs(self, reqs: list[_Request]) -> tuple[programs.Batch, programs.Sampling]:
        """The host side of a decode step: each row's last token, padded to the batch bucket (benches time it)."""
        B = _bucket(len(reqs), self.min_decode_bucket)
        return (self._batch(reqs, [[r.last_token] for r in reqs], [r.num_tokens - 1 for r in reqs], 1, B),
                self._sampling(reqs, B))

    def _sampling(self, reqs: list[_Request], B: int) -> programs.Sampling:
        return sampling_arrays(reqs, B, self.cfg.vocab_size, self._fail)

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        self._admit()
        outs: list[StepOutput] = []
        pre = [r for r in self.running.values() if r.prefilling]
        if pre:
            r = min(pre, key=lambda r: r.arrival)
            tok = self._prefill_chunk(r)
            if tok is not None:
                outs += self._accept(r, tok)
        dec = [r for r in self.running.values() if not r.prefilling and r.id in self.running]
        dec = [r for r in dec if not any(o.request_id == r.id for o in outs)]
        if dec:
            outs += self._decode(dec)
        return outs

    def _prefill_chunk(self, r: _Request) -> int | None:
        N = r.prefill_len
        end = min(N, r.computed + self.chunk)
        if r.replay_at and r.computed < r.replay_at:
            end = min(end, r.replay_at)
        while not self._ensure_pages(r, end):
            if not self._preempt(r):
                self._fail(r, f"request {r.id}: the KV pool ({self.layout.num_pages} pages) cannot hold "
                              f"{end} tokens; raise num_pages or lower max_model_len")
        chunk = r.token_range(r.computed, end)
        T = min(self.chunk, _bucket(len(chunk), self.min_prefill_bucket))
        b = self._batch([r], [chunk], [r.computed], T, 1)
        cfg = self.cfg
        last = end == N
        if self.replay:
            Nr = self.replay_tokens
            self.pool, h, pre = programs.run_encoder(self.params, self.pool, b, **self.static, replay_tokens=Nr)
            n = len(chunk)
            h, pre = h[0, Nr - min(n, Nr):], pre[0, Nr - min(n, Nr):]
            if r.tail is not None:
                h, pre = jnp.concatenate([r.tail[0], h])[-Nr:], jnp.concatenate([r.tail[1], pre])[-Nr:]
            r.tail = (h, pre)
            r.computed = end
            if r.replay_at and end == r.replay_at:
                self._restart_as_hit(r)
                return None
            if not last:
                return None
            Td = h.shape[0]
            lo = self.pool.ring_lo.at[cfg.split_layer + 1:, r.slot].set(N - Td)
            self.pool = dataclasses.replace(self.pool, ring_lo=lo)
            hp = jnp.zeros((1, Nr, *h.shape[1:]), h.dtype).at[0, :Td].set(h)
            pp = jnp.zeros((1, Nr, *pre.shape[1:]), pre.dtype).at[0, :Td].set(pre)
            bd = programs.Batch(b.tokens[:, :1], np.asarray([N - Td], np.int32), np.asarray([Td], np.int32),
                                b.slot, b.block_table, b.write_lo, [])
            self.pool, logits, tok = programs.run_decoder(self.params, self.pool, bd, hp, pp,
                                                          self._sampling([r], 1), **self.static)
            r.tail = None
        else:
            self.pool, logits, tok = programs.run_full(self.params, self.pool, b, self._sampling([r], 1),
                                                       **self.static)
            r.computed = end
            if not last:
                return None
        self.counters["prefill_tokens"] += N - r.start
        if self.keep_logits:
            r.logits.append(np.asarray(logits[0]))
        return int(tok[0])

    def _restart_as_hit(self, r: _Request) -> None:
        """After [0, H) ran, continue as a prefix-cache hit of H tokens would."""
        H = r.replay_at
        r.replay_at = 0
        start = max(0, H - self.replay_tokens)
        r.write_lo, r.start, r.computed, r.tail = H, start, start, None
        r.history = self._history_before(r, r.start)
        self.pool = dataclasses.replace(self.pool, ring_lo=self.pool.ring_lo.at[:, r.slot].set(r.start))

    def _decode(self, reqs: list[_Request]) -> list[StepOutput]:
        for r in list(reqs):
            if r.id not in self.running:  # preempted for an earlier row: back in the queue, it holds no pages
                continue
            while not self._ensure_pages(r, r.num_tokens):
                if not self._preempt(r):
                    self._fail(r, f"request {r.id}: the KV pool ({self.layout.num_pages} pages) cannot hold "
                                  f"{r.num_tokens} tokens; raise num_pages or lower max_model_len")
                reqs = [x for x in reqs if x.id in self.running]
        reqs = [r for r in reqs if r.id in self.running]
        if not reqs:
            return []
        b, samp = self.decode_inputs(reqs)
        self.pool, logits, tok = programs.run_full(self.params, self.pool, b, samp, **self.static)
        tok = np.asarray(tok)
        outs = []
        for i, r in enumerate(reqs):
            r.computed = r.num_tokens
            if self.keep_logits:
                r.logits.append(np.asarray(logits[i]))
            outs += self._accept(r, int(tok[i]))
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
