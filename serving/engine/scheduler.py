"""The engine's host scheduling: request state, admission (FCFS, with prefix-cache hits), KV page allocation,
preemption (the newest request is recomputed later), shape bucketing and the step's batch arrays.

`Scheduler` is mixed into `Engine`, whose state it reads and updates (layout, pool, prefix, waiting, running,
counters); it runs no program."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from serving.engine import programs
from serving.engine.errors import EngineError
from serving.engine.sampling import SamplingParams


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
    tail: tuple | None = None  # (stream, pre) of the last swa_replay_tokens encoder rows, replay mode
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
    """The shape bucket of n: lo times the smallest power of two that holds it (one compiled program each)."""
    b = lo
    while b < n:
        b *= 2
    return b


class Scheduler:
    """Admission, pages, preemption and batch arrays over the engine's state (see the module docstring)."""

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
            hit: list[int] = []
            if self.prefix:
                hit = self.prefix.match(self._block_keys(r, r.prefill_len - 1))
            H = len(hit) * self.layout.page_tokens
            for p in hit:
                self.prefix.acquire(p)
            r.pages = list(hit)
            r.cached = H
            r.write_lo = H
            # the encoder re-runs the hit's last swa_replay_tokens: the SWA rings, and the decoder's rows
            r.start = max(0, H - self.replay_tokens) if H else 0
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

    def _fail(self, r: _Request, msg: str) -> None:
        self.running.pop(r.id, None)
        self._free(r, keep=False)
        err = EngineError(msg)
        err.request_id = r.id
        raise err

    # ---- batches and buckets -------------------------------------------------------------------

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
        # host arrays: the jitted call moves them with its own (fast) argument transfer (the Engram rows too)
        b = programs.Batch(tokens, p0, n_valid, slot, bt, wlo, rows)
        return b

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
