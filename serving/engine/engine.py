"""The engine: requests in, tokens out, over the paged KV pool.

One `step()` runs at most one prefill chunk (chunked prefill, FCFS) and one decode step over every running
sequence. With SWA bounded replay (default) a prompt runs layers [0, split) and the split layer's KV writes on
every token (`run_encoder`, chunk by chunk), then the rest on its last `window` tokens (`run_decoder`). A prefix
cache keeps full pages of global KV; on a hit the encoder re-runs [H - window, H) to rebuild its SWA rings
without rewriting the cached KV (encoder-side replay). Not thread-safe: drive it from one thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import model, moe, nn, quant
from dsv41.config import ModelConfig
from dsv41.quant import Numerics
from pallas_kernels import expert_gemm, router
from serving.engine import kv_pool, packed_params, programs
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineError, QueueFull  # noqa: F401 (re-exported)
from serving.engine.kv_pool import PoolLayout
from serving.engine.prefix_cache import PrefixCache
from serving.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclasses.dataclass
class _Request:
    id: str
    prompt: list[int]
    sampling: SamplingParams
    session: str | None
    arrival: float
    output: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the pool
    prefill_len: int = 0  # tokens the current prefill covers: the prompt, or everything after a preemption
    start: int = 0  # first position of the prompt this prefill runs (replay start on a prefix hit)
    write_lo: int = 0  # global KV below this position is cached
    cached: int = 0
    block_keys: list = dataclasses.field(default_factory=list)  # prefix-cache keys of full pages, as far as hashed
    history: np.ndarray | None = None
    tail: tuple | None = None  # (stream, pre) of the last `window` encoder rows, replay mode
    steps: int = 0
    replay_at: int = 0  # rebuild the SWA from here as a prefix-cache hit at this length would (0 = never)
    logits: list = dataclasses.field(default_factory=list)  # with keep_logits: [V] per sampled token
    # `pages` as int32 for the block table, rebuilt only when pages were added or replaced (once per page of
    # decode steps): converting a 100K-token context's page list every step cost more than the device step
    _page_row: tuple = (None, 0, np.zeros(0, np.int32))

    # views of the sequence prompt + output that build no O(context) list (they run every step)
    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def token_range(self, lo: int, hi: int) -> list[int]:
        """(prompt + output)[lo:hi] without building the whole sequence."""
        n = len(self.prompt)
        return self.prompt[lo:min(hi, n)] + self.output[max(lo - n, 0):max(hi - n, 0)]

    def page_row(self) -> np.ndarray:
        src, n, row = self._page_row
        if src is not self.pages or n != len(self.pages):
            row = np.asarray(self.pages, np.int32)
            self._page_row = (self.pages, len(self.pages), row)
        return row

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_len


def _bucket(n: int, lo: int = 1) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


# 'xla': routed experts dequantized for lax.ragged_dot. 'pallas': the grouped FP4 Mosaic GPU kernel on the
# experts in its layout (converted once here). 'interpret': that kernel in the interpreter (CPU tests).
MOE_BACKENDS = ("xla", "pallas", "interpret")
# 'xla': FP8 linears dequantized inside the step. 'pallas': decode batches through the FP8 linear kernel
# (`nn.prepare_linears`, converted once here); 'interpret': in the interpreter. 'auto' -> 'pallas' on a GPU with
# FP8 linear weights (a release checkpoint) and bf16 activations, else 'xla': on the H200 (2026-12-01, release
# weights, bench preset) the kernel took the batch-1 decode step from 6.48 to 4.41 ms of device time, and 9-12% off
# batch 64 (2026-11-30; 9.13 -> 8.38 ms in 2026-12-01/02's calls). Engine runs repeat bit for bit with either (H200,
# 2026-12-02, compare_engine_runs.py: two runs each, identical logits at every step; the seventh session's two
# kernel runs differed, on code since changed in its K slices and the MoE's sums). The two backends differ by the
# kernel's rounding (0.0055 of the logits at the prefill), which flips a near-tied expert choice a few steps on
# (docs/PERFORMANCE.md, "Twentieth session").
LINEAR_BACKENDS = ("xla", "pallas", "interpret")
# 'auto' runs a fused site as its kernel in calls of up to this many tokens (None: every size) and in XLA above,
# from the H200's per-call times (2026-12-01, docs/PERFORMANCE.md, "Eighteenth session"): a block's two mHC sites
# took 18.4 us of GPU time as kernels against 34.6 in XLA (Sinkhorn unrolled) at 1 token, 236 against 164 at 512;
# at 64, 53.2 against 48.7 but in 9 launches against 19, so decode batches up to 64 keep the kernels. The router
# (Flash's 384 experts): 17.0 / 19.3 / 72.3 / 104.8 us against 17.3 / 29.2 / 70.5 / 182.8 at 1 / 64 / 512 / 2048
# tokens, so the kernel at every size.
SITE_KERNEL_MAX_TOKENS = {"mhc": 64, "router": None}


def resolve_linear_backend(params: dict, backend: str, num: Numerics) -> str:
    if backend not in ("auto", *LINEAR_BACKENDS):
        raise EngineError(f"linear_backend must be 'auto' or one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "xla":
        return "xla"
    is_fp8 = lambda w: isinstance(w, quant.Fp8Weight)
    fp8 = any(is_fp8(w) for w in jax.tree_util.tree_leaves(params["layers"], is_leaf=is_fp8))
    why = ("needs a CUDA GPU" if backend != "interpret" and jax.default_backend() != "gpu" else
           "needs FP8 linear weights (a release checkpoint, or init_params without dtype)" if not fp8 else
           f"needs bfloat16 activations (numerics dtype {num.dtype})" if num.jdtype != jnp.bfloat16 else "")
    if backend == "auto":
        return "xla" if why else "pallas"
    if why:
        raise EngineError(f"linear_backend={backend!r} {why}; use 'xla'")
    return backend


def resolve_backends(cfg: ModelConfig, params: dict, attention: str, moe_backend: str, mhc_backend: str = "auto",
                     router_backend: str = "auto", num: Numerics = quant.REFERENCE) -> tuple[str, str, model.Sites]:
    """-> (attention backend, MoE backend, the fused per-layer sites). 'auto' -> the Mosaic GPU kernels on a GPU
    where the shapes and weight formats allow them, else XLA. An explicit 'pallas' that cannot run raises
    EngineError saying why. 'auto' runs the mHC and router sites as kernels in calls of up to
    SITE_KERNEL_MAX_TOKENS tokens (the mHC sites: decode batches) and in XLA in larger ones, where the kernels were
    not faster on the H200; an explicit 'pallas' runs them at every size."""
    gpu = jax.default_backend() == "gpu"
    site = {"mhc": mhc_backend, "router": router_backend}
    try:
        router.select_tiling(cfg.n_routed_experts, cfg.n_activated_experts)
        selectable = True
    except ValueError:
        selectable = False
    shapes = {"mhc": f"needs dim % 128 == 0 (dim {cfg.dim})" if cfg.dim % 128 else "",
              "router": f"needs dim % 128 == 0, n_routed_experts a multiple of 64 up to 512 and at most 8 "
                        f"activated ({cfg.dim}, {cfg.n_routed_experts}, {cfg.n_activated_experts})"
              if cfg.dim % 128 or not selectable else ""}
    if num.jdtype != jnp.bfloat16:
        shapes["mhc"] = shapes["mhc"] or f"needs bfloat16 activations (numerics dtype {num.dtype})"
    for name, be in site.items():
        if be not in ("auto", *model.SITE_BACKENDS):
            raise EngineError(f"{name}_backend must be 'auto' or one of {model.SITE_BACKENDS}, got {be!r}")
        why = "needs a CUDA GPU" if be == "pallas" and not gpu else shapes[name] if be != "auto" else ""
        if be != "xla" and why:
            raise EngineError(f"{name}_backend={be!r} {why}; use 'xla'")
    auto = {n: "pallas" if gpu and not shapes[n] else "xla" for n in site}
    chosen = {n: auto[n] if be == "auto" else be for n, be in site.items()}
    limits = {f"{n}_max_tokens": SITE_KERNEL_MAX_TOKENS[n] for n, be in site.items()
              if be == "auto" and chosen[n] != "xla"}
    sites = model.Sites(**chosen, **limits)
    if attention not in ("auto", *programs.ATTENTION_BACKENDS):
        raise EngineError(f"attention_backend must be 'auto' or one of {programs.ATTENTION_BACKENDS}, "
                          f"got {attention!r}")
    if moe_backend not in ("auto", *MOE_BACKENDS):
        raise EngineError(f"moe_backend must be 'auto' or one of {MOE_BACKENDS}, got {moe_backend!r}")
    attn_why = ("needs a CUDA GPU" if not gpu else
                f"needs head_dim % 128 == 0 and n_heads <= 64 (head_dim {cfg.head_dim}, n_heads {cfg.n_heads})"
                if cfg.head_dim % 128 or cfg.n_heads > 64 else "")
    fp4 = all(isinstance(w, (quant.Fp4Weight, expert_gemm.PreparedFp4))
              for lp in params["layers"] for w in lp["ffn"]["experts"].values())
    moe_why = ("needs a CUDA GPU" if not gpu else
               "needs FP4 expert weights (a release checkpoint, or init_params without dtype)" if not fp4 else
               f"needs dim and moe_inter_dim multiples of 256 ({cfg.dim}, {cfg.moe_inter_dim})"
               if cfg.dim % 256 or cfg.moe_inter_dim % 256 else "")
    if attention == "auto":
        attention = "xla" if attn_why else "pallas"
    elif attention == "pallas" and attn_why:
        raise EngineError(f"attention_backend='pallas' {attn_why}; use 'xla'")
    if moe_backend == "auto":
        moe_backend = "xla" if moe_why else "pallas"
    elif moe_backend == "pallas" and moe_why:
        raise EngineError(f"moe_backend='pallas' {moe_why}; use 'xla'")
    elif moe_backend == "interpret" and not fp4:
        raise EngineError("moe_backend='interpret' needs FP4 expert weights")
    return attention, moe_backend, sites


ENGRAM_TRANSFERS = ("argument", "overlap")


def _engram_rows_home(engram_transfer: str) -> jax.sharding.Sharding | None:
    """Where a step's gathered Engram rows go before the jitted call. 'argument': nowhere (None): they are host
    arrays that the call copies to the GPU with its other arguments, before the program starts. 'overlap':
    pinned host memory; the program copies them itself (`programs._layers`), asynchronously, so the transfer
    runs beside the layers before each Engram layer (Flash: layers 1 and 14) instead of ahead of layer 0."""
    if engram_transfer not in ENGRAM_TRANSFERS:
        raise EngineError(f"engram_transfer={engram_transfer!r}: choose one of {list(ENGRAM_TRANSFERS)}")
    if engram_transfer == "argument":
        return None
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    if "pinned_host" not in kinds:
        raise EngineError(f"engram_transfer='overlap' stages rows in pinned host memory, which {dev.platform} "
                          f"device {dev} does not offer (it has {sorted(kinds)}); use 'argument'")
    return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")


class Engine:
    def __init__(self, cfg: ModelConfig, params: dict, tokenizer, hasher, config: EngineConfig = EngineConfig()):
        if not isinstance(config, EngineConfig):
            raise EngineError(f"config must be an EngineConfig, got {type(config).__name__}; "
                              f"pass engine options as EngineConfig(...) fields")
        self.config = config
        (numerics, attention_backend, moe_backend, mhc_backend, router_backend, linear_backend, engram_transfer,
         pack_params, kernel_options) = (config.numerics, config.attention_backend, config.moe_backend,
                                         config.mhc_backend, config.router_backend, config.linear_backend,
                                         config.engram_transfer, config.pack_params, config.kernel_options)
        max_num_seqs, page_tokens, min_ctx_pages = config.max_num_seqs, config.page_tokens, config.min_ctx_pages
        self.cfg, self.tokenizer, self.hasher, self.num = cfg, tokenizer, hasher, numerics
        self.attention_backend, self.moe_backend, self.sites = resolve_backends(
            cfg, params, attention_backend, moe_backend, mhc_backend, router_backend, numerics)
        # the programs' static keywords, exactly as every call passes them (jit's cache keys on them)
        self.static = {"cfg": cfg, "num": numerics, "backend": self.attention_backend, "sites": self.sites,
                       "opts": kernel_options}
        self.params, tables = model.strip_tables(params)
        if self.moe_backend != "xla":
            self.params = moe.prepare_experts(self.params, interpret=self.moe_backend == "interpret")
        self.linear_backend = resolve_linear_backend(self.params, linear_backend, numerics)
        if self.linear_backend != "xla":
            self.params = nn.prepare_linears(self.params, cfg, interpret=self.linear_backend == "interpret")
        if pack_params:  # the small arrays in a few buffers: fewer arguments a call (serving/engine/packed_params.py)
            self.params = packed_params.pack(self.params)
        # Engram tables are read by row on the host: keep them there (a device copy would be gathered row by row)
        self.tables = [t if isinstance(t.weight, np.ndarray)
                       else quant.Fp8Rows(np.asarray(t.weight), np.asarray(t.scale)) for t in tables]
        self._rows_home = _engram_rows_home(engram_transfer)
        self.max_model_len = min(config.max_model_len or cfg.max_seq_len, cfg.max_seq_len)
        self.replay = config.swa_bounded_replay and cfg.split_layer >= 0
        if config.max_num_batched_tokens < cfg.window_size:
            raise EngineError(f"max_num_batched_tokens={config.max_num_batched_tokens} is below the model's window "
                              f"({cfg.window_size}); raise it to at least {cfg.window_size}")
        self.chunk = config.max_num_batched_tokens
        pages_per_seq = -(-self.max_model_len // page_tokens)
        self.max_pages_per_seq = pages_per_seq
        self.min_prefill_bucket, self.min_ctx_pages = config.min_prefill_bucket, min(min_ctx_pages, pages_per_seq)
        self.min_decode_bucket = min(config.min_decode_bucket, _bucket(max_num_seqs))
        num_pages = config.num_pages or max_num_seqs * pages_per_seq
        self.layout = PoolLayout(num_pages=num_pages, page_tokens=page_tokens, num_slots=max_num_seqs)
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

    # ---- pages --------------------------------------------------------------------------------

    def _take_page(self) -> int | None:
        if self.free_pages:
            return self.free_pages.popleft()
        return self.prefix.evict() if self.prefix else None

    def _ensure_pages(self, r: _Request, upto: int) -> bool:
        need = -(-upto // self.layout.page_tokens)
        while len(r.pages) < need:
            p = self._take_page()
            if p is None:
                return False
            if self.prefix:
                self.prefix.acquire(p)
            r.pages.append(p)
        return True

    def _history_before(self, r: _Request, pos: int) -> np.ndarray | None:
        """The Engram hasher's history after r's first `pos` tokens (it reads only the last few)."""
        if self.hasher is None:
            return None
        tail = r.token_range(max(0, pos - self.hasher.history_len), pos)
        return self.hasher.history_from_ids(np.asarray([tail], np.int64))

    def _block_keys(self, r: _Request, upto: int) -> list[bytes]:
        """Prefix-cache keys of the full pages in r's first `upto` tokens. Hashed once per page over the request's
        life (a turn of a 142K-token conversation is 2200 pages: 22 ms of the engine thread to hash again)."""
        P = self.layout.page_tokens
        done = len(r.block_keys)
        if upto // P > done:
            r.block_keys += self.prefix.keys(r.token_range(done * P, upto), r.block_keys[-1] if done else b"")
        return r.block_keys[: upto // P]

    def _free(self, r: _Request, keep: bool) -> None:
        """Releases a request's slot and pages; with `keep`, its full pages enter the prefix cache."""
        if self.prefix and keep:
            for k, p in zip(self._block_keys(r, r.computed), r.pages):
                self.prefix.insert(k, p)
        for p in r.pages:
            if not (self.prefix and self.prefix.release(p)):
                self.free_pages.append(p)
        r.pages = []
        if r.slot >= 0:
            self.free_slots.append(r.slot)
            r.slot = -1

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            r = self.waiting[0]
            W = self.cfg.window_size
            hit: list[int] = []
            if self.prefix:
                hit = self.prefix.match(self._block_keys(r, r.prefill_len - 1))
            H = len(hit) * self.layout.page_tokens
            for p in hit:
                self.prefix.acquire(p)
            r.pages = list(hit)
            r.cached = H
            r.write_lo = H
            r.start = max(0, H - W) if H else 0
            r.computed = r.start
            if not self._ensure_pages(r, min(r.prefill_len, r.start + self.chunk)):
                for p in r.pages:
                    if not (self.prefix and self.prefix.release(p)):
                        self.free_pages.append(p)
                r.pages = []
                break
            self.waiting.popleft()
            if self.prefix:
                self.prefix.hit_tokens += H
                self.prefix.query_tokens += r.prefill_len
            r.slot = self.free_slots.popleft()
            r.history = self._history_before(r, r.start)
            r.tail = None
            lo = jnp.full((self.cfg.n_layers,), r.start, jnp.int32)
            self.pool = dataclasses.replace(self.pool, ring_lo=self.pool.ring_lo.at[:, r.slot].set(lo))
            self.running[r.id] = r

    def _preempt(self, keep: _Request) -> bool:
        """Frees the newest other running request (recompute later). -> False when there is none."""
        victims = [r for r in self.running.values() if r is not keep]
        if not victims:
            return False
        v = max(victims, key=lambda r: r.arrival)
        del self.running[v.id]
        self._free(v, keep=False)
        v.prefill_len, v.computed = v.num_tokens, 0  # recompute everything, then go on decoding
        self.waiting.appendleft(v)
        self.counters["preemptions"] += 1
        return True

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
        rows = model.engram_rows(self.tables, rid)
        return rows if self._rows_home is None else jax.device_put(rows, self._rows_home)

    def _batch(self, reqs: list[_Request], toks: list[list[int]], pos0: list[int], T: int, B: int) -> tuple:
        ctx_pages = min(self.max_pages_per_seq, _bucket(max(len(r.pages) for r in reqs), self.min_ctx_pages))
        P = self.layout.num_pages
        tokens = np.zeros((B, T), np.int32)
        bt = np.full((B, ctx_pages), P, np.int32)
        n_valid = np.zeros(B, np.int32)
        slot = np.full(B, self.layout.num_slots, np.int32)
        p0 = np.zeros(B, np.int32)
        wlo = np.zeros(B, np.int32)
        for i, (r, t, p) in enumerate(zip(reqs, toks, pos0)):
            try:
                tokens[i, : len(t)] = t
                n_valid[i] = len(t)
                bt[i, : len(r.pages)] = r.page_row()
                slot[i], p0[i], wlo[i] = r.slot, p, r.write_lo
            except (OverflowError, ValueError, TypeError) as e:
                self._fail(r, f"request {r.id}: its tokens or positions do not fit the step's arrays ({e})")
        rows = self._rows(reqs, toks, B, T)
        # host arrays: the jitted call moves them with its own (fast) argument transfer (the Engram rows too,
        # unless they are staged in pinned host memory for the program to copy: engram_transfer="overlap")
        b = programs.Batch(tokens, p0, n_valid, slot, bt, wlo, rows)
        return b

    def decode_inputs(self, reqs: list[_Request]) -> tuple[programs.Batch, programs.Sampling]:
        """The host side of a decode step: each row's last token, padded to the batch bucket (benches time it)."""
        B = _bucket(len(reqs), self.min_decode_bucket)
        return (self._batch(reqs, [[r.last_token] for r in reqs], [r.num_tokens - 1 for r in reqs], 1, B),
                self._sampling(reqs, B))

    def _sampling(self, reqs: list[_Request], B: int) -> programs.Sampling:
        t = np.zeros(B, np.float32)
        tp = np.ones(B, np.float32)
        tk = np.zeros(B, np.int32)
        key = np.zeros((B, 2), np.uint32)
        V = self.cfg.vocab_size
        for i, r in enumerate(reqs):
            s = r.sampling
            try:
                # top_k >= V keeps every token, as 0 does: the int32 row always holds it
                t[i], tp[i], tk[i] = s.temperature, s.top_p, 0 if s.top_k >= V else s.top_k
                seed = s.seed if s.seed is not None else hash(r.id) & 0xFFFFFFFF
                key[i] = (seed & 0xFFFFFFFF, r.steps)
            except (OverflowError, ValueError, TypeError) as e:
                self._fail(r, f"request {r.id}: sampling values {s} do not fit the step's arrays ({e}); "
                              f"give values within the documented ranges")
        for r in reqs:  # only once every row filled: a failed row leaves the others' sampling keys as they were
            r.steps += 1
        return programs.Sampling(t, tp, tk, key)

    # ---- warm-up ------------------------------------------------------------------------------

    def program_shapes(self) -> list[tuple[str, int, int, int]]:
        """Every (program, rows B, tokens T, block-table pages) a step of this engine can call, from its shape
        buckets. Coarser buckets (min_prefill_bucket = the chunk, min_ctx_pages = the longest sequence's pages,
        min_decode_bucket = max_num_seqs) mean fewer programs and more padding."""

        def ladder(lo: int, hi: int) -> list[int]:
            out, b = [], lo
            while b < hi:
                out.append(b)
                b *= 2
            return out + [hi]

        ctxs = ladder(self.min_ctx_pages, self.max_pages_per_seq)
        chunks = ladder(min(self.min_prefill_bucket, self.chunk), self.chunk)
        prefill = "encoder" if self.replay else "full"
        shapes = [(prefill, 1, T, c) for T in chunks for c in ctxs]
        if self.replay:
            shapes += [("decoder", 1, 1, c) for c in ctxs]
        decode_top = _bucket(self.layout.num_slots, self.min_decode_bucket)
        shapes += [("decode", B, 1, c) for B in ladder(self.min_decode_bucket, decode_top) for c in ctxs]
        return shapes

    def _padding_call(self, kind: str, B: int, T: int, ctx: int):
        """(jitted program, args, static kwargs) for an all-padding batch of that shape: it writes nothing."""
        P, S = self.layout.num_pages, self.layout.num_slots
        rows = [] if kind == "decoder" else self._rows([], [], B, T)
        b = programs.Batch(np.zeros((B, T), np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32),
                           np.full(B, S, np.int32), np.full((B, ctx), P, np.int32), np.zeros(B, np.int32), rows)
        samp = self._sampling([], B)
        static = self.static
        if kind == "encoder":
            return programs.run_encoder, (self.params, self.pool, b), static
        if kind == "decoder":
            W, hc, on = self.cfg.window_size, self.cfg.hc_mult, self.pool.ring_lo.sharding
            # committed like the step's, which come out of the encoder: a program compiles once per committed /
            # uncommitted signature of its arguments (tests/test_engine.py::test_warmup_leaves_nothing_to_compile)
            h = jnp.zeros((1, W, hc, self.cfg.dim), self.num.jdtype, device=on)
            pre = jnp.zeros((1, W, hc), jnp.float32, device=on)
            return programs.run_decoder, (self.params, self.pool, b, h, pre, samp), static
        return programs.run_full, (self.params, self.pool, b, samp), static

    def warmup(self, workers: int = 8) -> list[tuple[str, int, int, int]]:
        """Compiles and loads every program of `program_shapes()` so that no request waits for a compile (the
        serving analog of capturing CUDA graphs at start-up). With a persistent compilation cache configured,
        the programs are first compiled in `workers` threads at once (XLA compiles off the GIL), then each runs
        once on an all-padding batch, which loads it from that cache. -> the shapes."""
        shapes = self.program_shapes()
        t0 = time.perf_counter()
        if jax.config.jax_compilation_cache_dir and workers > 1:
            def compile_one(shape):
                fn, args, static = self._padding_call(*shape)
                fn.lower(*args, **static).compile()

            with concurrent.futures.ThreadPoolExecutor(workers) as ex:
                list(ex.map(compile_one, shapes))
            log.info("compiled %d programs in %.1f s (%d threads)", len(shapes), time.perf_counter() - t0, workers)
        for shape in shapes:
            fn, args, static = self._padding_call(*shape)
            out = fn(*args, **static)
            self.pool = out[0]
        jax.block_until_ready(self.pool)
        log.info("warm-up: %d programs ready in %.1f s", len(shapes), time.perf_counter() - t0)
        return shapes

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
            self.pool, h, pre = programs.run_encoder(self.params, self.pool, b, **self.static)
            n = len(chunk)
            W = cfg.window_size
            h, pre = h[0, W - min(n, W):], pre[0, W - min(n, W):]
            if r.tail is not None:
                h, pre = jnp.concatenate([r.tail[0], h])[-W:], jnp.concatenate([r.tail[1], pre])[-W:]
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
            hp = jnp.zeros((1, W, *h.shape[1:]), h.dtype).at[0, :Td].set(h)
            pp = jnp.zeros((1, W, *pre.shape[1:]), pre.dtype).at[0, :Td].set(pre)
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

    def _fail(self, r: _Request, msg: str) -> None:
        self.running.pop(r.id, None)
        self._free(r, keep=False)
        err = EngineError(msg)
        err.request_id = r.id
        raise err

    def _restart_as_hit(self, r: _Request) -> None:
        """After [0, H) ran, continue as a prefix-cache hit of H tokens would."""
        H, W = r.replay_at, self.cfg.window_size
        r.replay_at = 0
        r.write_lo, r.start, r.computed, r.tail = H, max(0, H - W), max(0, H - W), None
        r.history = self._history_before(r, r.start)
        self.pool = dataclasses.replace(self.pool, ring_lo=self.pool.ring_lo.at[:, r.slot].set(r.start))

    def _decode(self, reqs: list[_Request]) -> list[StepOutput]:
        for r in list(reqs):
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
