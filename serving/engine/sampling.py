"""Per-request sampling values and their host-side per-row arrays; the device-side `sample()` is in programs.py."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from serving.engine import programs
from serving.engine.errors import EngineError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise EngineError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise EngineError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise EngineError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")


def sampling_arrays(rows: list, vocab_size: int, fail: Callable[[Any, str], None]) -> programs.Sampling:
    """The step's per-row sampling arrays for `rows` (a request per row, None for padding); advances each
    request's sampling step. A row whose values do not fit its array calls `fail(request, message)`, which raises
    for that request only."""
    B = len(rows)
    t = np.zeros(B, np.float32)
    tp = np.ones(B, np.float32)
    tk = np.zeros(B, np.int32)
    key = np.zeros((B, 2), np.uint32)
    for i, r in enumerate(rows):
        if r is None:
            continue
        s = r.sampling
        try:
            # top_k >= V keeps every token, as 0 does: the int32 row always holds it
            t[i], tp[i], tk[i] = s.temperature, s.top_p, 0 if s.top_k >= vocab_size else s.top_k
            seed = s.seed if s.seed is not None else hash(r.id) & 0xFFFFFFFF
            key[i] = (seed & 0xFFFFFFFF, r.steps)
        except (OverflowError, ValueError, TypeError) as e:
            fail(r, f"request {r.id}: sampling values {s} do not fit the step's arrays ({e}); "
                    f"give values within the documented ranges")
    # only once every row filled: a failed row leaves the others' sampling keys as they were
    for r in filter(None, rows):
        r.steps += 1
    return programs.Sampling(t, tp, tk, key)
