"""The engine's errors, shared by its modules and the async layer."""

from __future__ import annotations


class EngineError(ValueError):
    """A request the engine cannot take (bad ids, too long, bad sampling values) or cannot finish; raised from
    `step()` it names the failed request in `request_id` (that request is dropped, the others go on)."""

    request_id: str | None = None


class QueueFull(RuntimeError):
    """The waiting queue is full: retry later."""
