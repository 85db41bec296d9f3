"""A small stand-in with the synchronous Engine API, for serving tests that need scripted output or fault
injection (the real tiny engine's random weights never write DSML, and it does not fail on demand).

Behaviour: prompts are prefilled in chunks of `max_num_batched_tokens` (shared by the batch), one token per
decode step after that; pages of `page_size` tokens are held per running request and freed at finish/abort; full
prompt pages of finished requests go to a prefix cache, so a later prompt with the same prefix reports
num_cached_tokens. `warmup()` stands in for the compiles: `warmup_programs` programs of `warmup_delay_s` each,
reported through the same `warmup_progress` as the real engine's. Output tokens are pseudo-random ids from the seed (or the prompt), or, when the decoded prompt
contains a key of `replies`, the tokens of that reply text followed by EOS.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import time
from collections import deque

from dsv41.tokenizer import load_tokenizer
from serving.async_engine import EngineError, QueueFull, SamplingParams, StepOutput
from serving.engine.warmup_progress import ProgramReport, WarmupProgress


@dataclasses.dataclass
class _Req:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    session: str | None
    cached: int
    rng: random.Random
    reply: list[int] | None
    poisoned: bool = False
    prefilled: int = 0
    out: list[int] = dataclasses.field(default_factory=list)


class FakeEngine:
    def __init__(self, *, max_model_len: int = 2048, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                 max_waiting: int = 64, page_size: int = 16, num_pages: int = 1024, step_delay_s: float = 0.001,
                 replies: dict[str, str] | None = None, warmup_programs: int = 4,
                 warmup_delay_s: float = 0.0) -> None:
        self.tokenizer = load_tokenizer()
        self.warmup_programs = warmup_programs
        self.warmup_delay_s = warmup_delay_s
        self.warmup_progress = WarmupProgress()
        self.warmup_gate = None  # a threading.Semaphore: each program takes one release (tests step warm-up)
        self._staged_left = 0  # a staged warm-up's programs not yet ready
        self.cfg = None
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.page_size = page_size
        self.num_pages = num_pages
        self.step_delay_s = step_delay_s
        self.replies = dict(replies or {})
        self.fail_next_steps = 0  # fault injection: that many next steps raise (naming no request)
        self.poison = "POISON"  # a running request whose prompt holds this makes step() raise naming it
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._cache: set[bytes] = set()
        self._hits = 0
        self._queries = 0
        self.aborted: list[str] = []
        self.sessions: dict[str, str | None] = {}  # request id -> session key it was added with
        self.added: dict[str, tuple[list[int], SamplingParams]] = {}  # request id -> (prompt ids, sampling)
        self._normal_ids = [i for i in range(self.tokenizer.vocab_size) if i not in self.tokenizer.special_ids]

    # ---- API ----

    def warmup(self, should_stop=None, staged: bool = False) -> list[tuple[str, int, int, int]]:
        """staged: returns after the first program; each later step readies one more (the real engine's background
        compiles, in step order)."""
        shapes = [("decode", 1 << i, 1, 1) for i in range(self.warmup_programs)]
        self.warmup_progress.start(len(shapes))
        self._staged_left = len(shapes) - 1 if staged else 0
        for kind, B, T, pages in shapes[:1] if staged else shapes:
            if should_stop is not None and should_stop():
                return []
            while self.warmup_gate is not None and not self.warmup_gate.acquire(timeout=0.02):
                if should_stop is not None and should_stop():
                    return []
            time.sleep(self.warmup_delay_s)
            self.warmup_progress.compiled(ProgramReport(kind, B, T, pages, 0.0, self.warmup_delay_s, "compiled"))
            self.warmup_progress.loaded()
        if not self._staged_left:
            self.warmup_progress.finish()
        return shapes

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                    session: str | None = None) -> None:
        if not prompt_ids:
            raise EngineError("empty prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens does not fit max_model_len {self.max_model_len}")
        if any(not 0 <= i < self.tokenizer.vocab_size for i in prompt_ids):
            raise EngineError("token id out of range")
        if any(r.rid == request_id for r in (*self._waiting, *self._running)):
            raise EngineError(f"duplicate request id {request_id}")
        if len(self._waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self._waiting)} requests waiting")
        self.sessions[request_id] = session
        self.added[request_id] = (list(prompt_ids), sampling)
        cached = self._cached_prefix(prompt_ids)
        self._queries += len(prompt_ids)
        self._hits += cached
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(self._key(prompt_ids)[:8], "little")
        text = self.tokenizer.decode(prompt_ids)
        reply = next((self.tokenizer.encode(v) + [self.tokenizer.eos_id] for k, v in self.replies.items()
                      if k in text), None)
        self._waiting.append(_Req(request_id, list(prompt_ids), sampling, session, cached, random.Random(seed),
                                  reply, poisoned=self.poison in text, prefilled=cached))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._waiting = deque(r for r in self._waiting if r.rid != request_id)
        self._running = [r for r in self._running if r.rid != request_id]

    def waiting_request_ids(self) -> list[str]:
        return [r.rid for r in self._waiting]

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def adopt_programs(self) -> None:
        """(The fake's staged programs arrive with its steps only, so tests see the padded phase.)"""

    def step(self) -> list[StepOutput]:
        if self._staged_left:
            self._staged_left -= 1
            self.warmup_progress.compiled(ProgramReport("decode", 0, 1, 1, 0.0, 0.0, "compiled"))
            self.warmup_progress.loaded()
            if not self._staged_left:
                self.warmup_progress.finish()
        if self.fail_next_steps:
            self.fail_next_steps -= 1
            raise RuntimeError("injected step failure")
        time.sleep(self.step_delay_s)
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._running.append(self._waiting.popleft())
        for r in self._running:
            if r.poisoned:
                err = EngineError(f"request {r.rid}: injected failure")
                err.request_id = r.rid
                raise err
        budget = self.max_num_batched_tokens
        outs = []
        for r in list(self._running):
            if r.prefilled < len(r.prompt):
                take = min(budget, len(r.prompt) - r.prefilled)
                budget -= take
                r.prefilled += take
                if r.prefilled < len(r.prompt):
                    continue
            elif budget <= 0:
                continue
            else:
                budget -= 1
            tok = self._next_token(r)
            r.out.append(tok)
            reason = None
            if (tok == self.tokenizer.eos_id and not r.sampling.ignore_eos) or tok in r.sampling.stop_token_ids:
                reason = "stop"
            elif len(r.out) >= r.sampling.max_tokens or len(r.prompt) + len(r.out) >= self.max_model_len:
                reason = "length"
            if reason:
                self._running.remove(r)
                self._remember(r.prompt)
            outs.append(StepOutput(r.rid, [tok], reason is not None, reason, len(r.prompt), r.cached))
        return outs

    def stats(self) -> dict:
        used = sum(math.ceil((len(r.prompt) + len(r.out)) / self.page_size) for r in self._running)
        return {"running": len(self._running), "waiting": len(self._waiting), "kv_pages_used": used,
                "kv_pages_total": self.num_pages, "prefix_cache_hit_tokens": self._hits,
                "prefix_cache_query_tokens": self._queries}

    # ---- internals ----

    def _next_token(self, r: _Req) -> int:
        if r.reply is not None:
            return r.reply[min(len(r.out), len(r.reply) - 1)]
        return r.rng.choice(self._normal_ids)

    @staticmethod
    def _key(ids: list[int]) -> bytes:
        return hashlib.blake2b(str(ids).encode(), digest_size=16).digest()

    def _cached_prefix(self, ids: list[int]) -> int:
        n = 0
        for end in range(self.page_size, len(ids), self.page_size):  # the last token is always computed
            if self._key(ids[:end]) not in self._cache:
                break
            n = end
        return n

    def _remember(self, ids: list[int]) -> None:
        for end in range(self.page_size, len(ids) + 1, self.page_size):
            self._cache.add(self._key(ids[:end]))
