"""Per-request sampling values and their host-side per-row arrays; the device-side `sample()` is in programs.py."""

from __future__ import annotations

import dataclasses

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
