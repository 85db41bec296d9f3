"""The engine's host scheduling: request state, admission (FCFS, with prefix-cache hits), routing to a
data-parallel rank, KV page allocation, preemption (the newest request on the rank is recomputed later), shape
bucketing and the step's batch arrays.

`Scheduler` is mixed into `Engine`, whose state it reads and updates (layout, ranks, waiting, running, counters);
it runs no program. Each data-parallel rank owns its pool: its free pages and slots, its prefix cache; page and
slot ids are rank-local. One rank is the single-device engine."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from serving.engine import images as im
from serving.engine import programs
from serving.engine.errors import EngineError
from serving.engine.prefix_cache import PrefixCache
from serving.engine.sampling import SamplingParams


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
    rank: int = -1  # the data-parallel rank that holds its KV
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the pool
    prefill_len: int = 0  # tokens the current prefill covers: the prompt, or everything after a preemption
    start: int = 0  # first position of the prompt this prefill runs (replay start on a prefix hit)
    write_lo: int = 0  # global KV below this position is cached
    cached: int = 0
    block_keys: list = dataclasses.field(default_factory=list)  # prefix-cache keys of full pages, as far as hashed
    history: np.ndarray | None = None
    # replay mode: (stream [R, hc, D], pre [R, hc], n) of the encoder's last R = swa_replay_tokens rows so far, the
    # n <= R real ones at the end
    tail: tuple | None = None
    steps: int = 0
    replay_at: int = 0  # rebuild the SWA from here as a prefix-cache hit at this length would (0 = never)
    decoder_lo: int = 0  # replay: the decoder layers' rings serve positions >= this (N - its tail, once prefilled)
    logits: list = dataclasses.field(default_factory=list)  # with keep_logits: [V] per sampled token
    images: tuple = ()  # images.PromptImage per image span of the prompt, in order
    image_rows: dict = dataclasses.field(default_factory=dict)  # id(image) -> its span rows, during a prefill
    drafts: list = dataclasses.field(default_factory=list)  # speculative decoding: the tokens the next step verifies
    drafts_drawn: bool = False  # they are the drafter's, drawn in this slot's last step (its states in the pool)
    # device feed (`device_feed.py`): decode tokens dispatched and not read yet, and the row of the last decode step
    # that sampled the newest (rank-local)
    in_flight: int = 0
    fed_row: int = -1
    # `pages` as int32 for the block table, rebuilt only when pages were added or replaced (once per page of
    # decode steps): converting a 100K-token context's page list every step cost more than the device step
    _page_row: tuple = (None, 0, np.zeros(0, np.int32))
    _ring_lo_row: tuple = (None, None)  # ((start, decoder_lo), int32 [L]): Scheduler._ring_lo's cache

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


def _ladder(lo: int, hi: int) -> list[int]:
    """The buckets from lo up to hi: lo times powers of two below hi, then hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def shared_prefill_shape(rows: int, chunk: int, min_bucket: int) -> tuple[int, int] | None:
    """(rows a rank, tokens a row) of the prefill call that short prompts share: the largest prefill bucket T
    with rows x T <= chunk, so the call costs no more tokens than a whole chunk. None: off (one row, or no bucket
    that small)."""
    fits = [T for T in _ladder(min(min_bucket, chunk), chunk) if rows * T <= chunk]
    return (rows, fits[-1]) if rows > 1 and fits else None


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A dispatched program's sampled tokens, not read yet: rows (a request per row, None where nothing was
    sampled), tok int32 [B] (a speculative step's: its outputs, `Speculative._accept_spec`'s spec), logits [B, V]
    (keep_logits, else None); n_verify: a speculative step's drafts verified a row (None: not one)."""

    rows: list
    tok: Any
    logits: Any
    n_verify: np.ndarray | None = None


@dataclasses.dataclass
class Rank:
    """One data-parallel rank's share of the pool: free pages and slots (rank-local ids), its prefix cache."""

    free_pages: collections.deque
    free_slots: collections.deque
    prefix: PrefixCache | None

    @classmethod
    def empty(cls, num_pages: int, num_slots: int, prefix: PrefixCache | None) -> "Rank":
        return cls(collections.deque(range(num_pages)), collections.deque(range(num_slots)), prefix)


class Scheduler:
    """Admission, routing, pages, preemption and batch arrays over the engine's state (see the module docstring)."""

    # ---- pages --------------------------------------------------------------------------------

    def _take_page(self, rank: Rank) -> int | None:
        if rank.free_pages:
            return rank.free_pages.popleft()
        return rank.prefix.evict() if rank.prefix else None

    def _ensure_pages(self, r: _Request, upto: int) -> bool:
        rank = self.ranks[r.rank]
        need = -(-upto // self.layout.page_tokens)
        while len(r.pages) < need:
            p = self._take_page(rank)
            if p is None:
                return False
            if rank.prefix:
                rank.prefix.acquire(p)
            r.pages.append(p)
        return True

    def _hold_pages(self, r: _Request, upto: int) -> None:
        """r's pages for its first `upto` tokens, preempting on its rank until they fit (or failing r)."""
        while not self._ensure_pages(r, upto):
            if not self._preempt(r):
                self._fail(r, f"request {r.id}: the KV pool ({self.layout.num_pages} pages) cannot hold "
                              f"{upto} tokens; raise num_pages or lower max_model_len")

    def _history_before(self, r: _Request, pos: int) -> np.ndarray | None:
        """The Engram hasher's history after r's first `pos` tokens (it reads only the last few)."""
        if self.hasher is None:
            return None
        lo = max(0, pos - self.hasher.history_len)
        tail = r.token_range(lo, pos)
        dead = im.mask(r.images, lo, pos)
        return self.hasher.history_from_ids(np.asarray([tail], np.int64), None if dead is None else dead[None])

    def _block_keys(self, r: _Request, upto: int) -> list[bytes]:
        """Prefix-cache keys of the full pages in r's first `upto` tokens. Hashed once per page over the request's
        life (a turn of a 142K-token conversation is 2200 pages: 22 ms of the engine thread to hash again)."""
        P = self.layout.page_tokens
        done = len(r.block_keys)
        if upto // P > done:
            keyer = self.ranks[0].prefix  # every rank keys pages alike
            salts = im.page_salts(r.images, done, upto // P, P) if r.images else ()
            r.block_keys += keyer.keys(r.token_range(done * P, upto), r.block_keys[-1] if done else b"", salts)
        return r.block_keys[: upto // P]

    def _release_pages(self, rank: Rank, pages: list[int]) -> None:
        for p in pages:
            if not (rank.prefix and rank.prefix.release(p)):
                rank.free_pages.append(p)

    def _free(self, r: _Request, keep: bool) -> None:
        """Releases a request's slot and pages; with `keep`, its full pages enter its rank's prefix cache."""
        if r.rank < 0:
            return
        rank = self.ranks[r.rank]
        if rank.prefix and keep:
            for k, p in zip(self._block_keys(r, r.computed), r.pages):
                rank.prefix.insert(k, p)
        self._release_pages(rank, r.pages)
        r.pages = []
        if r.slot >= 0:
            rank.free_slots.append(r.slot)
            r.slot = -1

    def _route(self, r: _Request, keys: list[bytes]) -> tuple[int, list[int]]:
        """The rank for a new request and its prefix-cache hit there: its conversation's rank while that rank
        has a free slot (session affinity: the conversation's prefix is cached there), else the rank with the
        longest hit, else the least loaded. -> (rank, hit pages), rank -1 when no rank has a free slot."""
        open_ranks = [i for i, k in enumerate(self.ranks) if k.free_slots]
        if not open_ranks:
            return -1, []
        hits = {i: self.ranks[i].prefix.match(keys) if self.ranks[i].prefix else [] for i in open_ranks}
        home = self.session_rank.get(r.session) if r.session is not None else None
        if home in hits:
            return home, hits[home]
        load = {i: sum(1 for x in self.running.values() if x.rank == i) for i in open_ranks}
        best = max(open_ranks, key=lambda i: (len(hits[i]), -load[i], -i))
        return best, hits[best]

    def _admit(self) -> None:
        while self.waiting:
            r = self.waiting[0]
            keys = self._block_keys(r, r.prefill_len - 1) if self.prefix_caching else []
            i, hit = self._route(r, keys)
            if i < 0:
                break
            rank = self.ranks[i]
            H = len(hit) * self.layout.page_tokens
            for p in hit:
                rank.prefix.acquire(p)
            r.rank, r.pages = i, list(hit)
            r.cached = H
            r.write_lo = H
            # the encoder re-runs the hit's last swa_replay_tokens: the SWA rings, and the decoder's rows
            r.start = max(0, H - self.replay_tokens) if H else 0
            r.computed = r.start
            r.decoder_lo = 0
            if not self._ensure_pages(r, min(r.prefill_len, r.start + self.chunk)):
                self._release_pages(rank, r.pages)
                r.pages, r.rank = [], -1
                break
            self.waiting.popleft()
            if rank.prefix:
                rank.prefix.hit_tokens += H
                rank.prefix.query_tokens += r.prefill_len
            if r.session is not None:
                self.session_rank[r.session] = i
                self.session_rank.move_to_end(r.session)
                while len(self.session_rank) > self.max_sessions:
                    self.session_rank.popitem(last=False)
            r.slot = rank.free_slots.popleft()
            r.drafts, r.drafts_drawn = [], False  # a new slot holds no drafter states of this request
            r.history = self._history_before(r, r.start)
            r.tail = None
            self.running[r.id] = r

    def _preempt(self, keep: _Request) -> bool:
        """Frees the newest other running request on keep's rank (recompute later). -> False when there is none."""
        victims = [r for r in self.running.values() if r is not keep and r.rank == keep.rank]
        if not victims:
            return False
        v = max(victims, key=lambda r: r.arrival)
        del self.running[v.id]
        v.in_flight = 0  # a token of it still in flight is read as a preempted request's (`_accept_preempted`)
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

    def _placed(self, reqs: list[_Request], per_rank: int) -> list[_Request | None]:
        """The step's rows: rank d's requests at rows [d * per_rank, (d + 1) * per_rank), None for padding."""
        rows: list[_Request | None] = [None] * (per_rank * len(self.ranks))
        used = [0] * len(self.ranks)
        for r in reqs:
            rows[r.rank * per_rank + used[r.rank]] = r
            used[r.rank] += 1
        return rows

    def _ring_lo(self, r: _Request) -> np.ndarray:
        """int32 [L]: the first position each layer's ring may serve for r (bounded replay's clip). Built when
        (start, decoder_lo) changes, not every decode step."""
        key, lo = r._ring_lo_row
        if key != (r.start, r.decoder_lo):
            lo = np.full(self.cfg.n_layers, r.start, np.int32)
            lo[self.cfg.split_layer + 1:] = max(r.start, r.decoder_lo)
            r._ring_lo_row = ((r.start, r.decoder_lo), lo)
        return lo

    def _batch(self, rows: list[_Request | None], toks: dict, pos0: dict, T: int, engram: bool = True
               ) -> programs.Batch:
        """The step's batch: rows as `_placed` lays them out; toks / pos0 by request id. engram False: no Engram
        rows (the program gathers them: `device_feed.py`)."""
        # one block-table width per engine: the programs read each row's real length at run time
        ctx_pages = self.max_pages_per_seq
        B, L = len(rows), self.cfg.n_layers
        P = self.layout.num_pages
        tokens = np.zeros((B, T), np.int32)
        bt = np.full((B, ctx_pages), P, np.int32)
        n_valid = np.zeros(B, np.int32)
        slot = np.full(B, self.layout.num_slots, np.int32)
        p0 = np.zeros(B, np.int32)
        wlo = np.zeros(B, np.int32)
        rlo = np.zeros((B, L), np.int32)
        for i, r in enumerate(rows):
            if r is None:
                continue
            t = toks[r.id]
            try:
                tokens[i, : len(t)] = t
                n_valid[i] = len(t)
                bt[i, : len(r.pages)] = r.page_row()
                slot[i], p0[i], wlo[i] = r.slot, pos0[r.id], r.write_lo
                rlo[i] = self._ring_lo(r)
            except (OverflowError, ValueError, TypeError) as e:
                self._fail(r, f"request {r.id}: its tokens or positions do not fit the step's arrays ({e})")
        # rows that may reach an image span (decode rows of a request with images start past its last one)
        chunks = [(int(p0[i]), int(n_valid[i]), r.images) if r is not None and r.images and p0[i] < r.images[-1].end
                  else None for i, r in enumerate(rows)]
        embeds, mask = (None, None) if not any(chunks) else self._image_rows(chunks, B, T)
        erows = self._rows(rows, [toks[r.id] if r is not None else [] for r in rows], B, T, mask) if engram else []
        # host arrays: the jitted call moves them with its own (fast) argument transfer (the Engram rows too)
        return programs.Batch(tokens, p0, n_valid, slot, bt, wlo, rlo, erows, embeds, mask)

    def program_shapes(self) -> list[tuple[str, int, int, int]]:
        """Every (program, rows B, tokens T, block-table pages) a step of this engine can call, from its shape
        buckets (B counts every rank's rows), the short prompts' shared prefill call included, and the all-greedy
        speculative step's program where it has one of its own (`greedy_kind`). The block table is
        always max_pages_per_seq wide (the context length is a run-time value); coarser buckets
        (min_prefill_bucket = the chunk, min_decode_bucket = max_num_seqs) mean fewer programs and more padding."""

        D, c = len(self.ranks), self.max_pages_per_seq
        chunks = _ladder(min(self.min_prefill_bucket, self.chunk), self.chunk)
        prefill = "encoder" if self.replay else "full"
        shapes = [(prefill, D, T, c) for T in chunks]
        if self.shared_prefill:
            R, T = self.shared_prefill
            shapes.append((prefill, D * R, T, c))
        if self.replay:
            shapes += [("decoder", D * R, 1, c) for R in (1, *(self.shared_prefill or ())[:1])]
        decode_top = _bucket(self.layout.num_slots, self.min_decode_bucket)
        kinds = self.decode_kinds + ((self.greedy_kind,) if self.greedy_kind else ())
        shapes += [(k, D * B, self.decode_tokens, c) for B in _ladder(self.min_decode_bucket, decode_top)
                   for k in kinds]
        return shapes

    def covering_shapes(self) -> list[tuple[str, int, int, int]]:
        """The programs every step can run on alone, padded: the largest prefill chunk, the replay decoder of one
        row a rank and the largest decode batch, both its programs where the step is split (a staged warm-up serves
        on these while the others compile)."""
        shapes = self.program_shapes()
        D = len(self.ranks)
        prefill = max((s for s in shapes if s[0] in ("encoder", "full") and s[1] == D), key=lambda s: s[2])
        decoder = [s for s in shapes if s[0] == "decoder" and s[1] == D]
        B = max(s[1] for s in shapes if s[0] in self.decode_kinds)
        return [prefill, *decoder, *(s for s in shapes if s[0] in self.decode_kinds and s[1] == B)]

    def _usable(self, kind: str, B: int, T: int) -> tuple[int, int]:
        """(rows, tokens) of the program a call of `kind` with B rows (every rank's) of T tokens runs: its own
        bucket, or while a staged warm-up's other programs compile (`usable_shapes`), the smallest usable program
        of that kind that holds it with the same rows (prefill: more tokens) or the same tokens (decode: more
        rows). A decode step split in two programs (`decode_kinds`) can use a shape once both are usable."""
        u, c = self.usable_shapes, self.max_pages_per_seq
        kinds = self.decode_kinds if kind == "decode" else (kind,)

        def usable(b: int, t: int) -> bool:
            return all((k, b, t, c) in u for k in kinds)

        if u is None or usable(B, T):
            return B, T
        fits = [(b, t) for k, b, t, _ in u if k == kinds[0] and b >= B and t >= T and (b == B or t == T)
                and usable(b, t)]
        if not fits:
            raise EngineError(f"no usable {kind} program holds {B} rows x {T} tokens (usable: {sorted(u)})")
        return min(fits, key=lambda bt: bt[0] * bt[1])
