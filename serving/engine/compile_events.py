"""What a block of code compiled, read off jax's monitoring events: how long tracing + lowering and XLA's
compile took, and whether each compile was loaded from the persistent compilation cache.

jax records its events in the thread that compiles, and warm-up compiles in several threads at once, so one
listener (registered once per process) adds each event to the `Compiles` of the block open in that thread.

    with compile_events.capture() as c:
        fn(*args)
    c.source  # "cache hit", "compiled" or "in memory" (jit's own cache had it: nothing compiled)
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

from jax import monitoring

# jax 0.11's names (jax/_src/compiler.py, jax/_src/dispatch.py)
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_MISS = "/jax/compilation_cache/cache_misses"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
# wraps the persistent-cache lookup too: a hit also records one (with the load time)
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

HIT, COMPILED, IN_MEMORY = "cache hit", "compiled", "in memory"
# a warm-up's source for an executable loaded from the program store (`serving.engine.executables`): not traced
STORED = "stored"


@dataclasses.dataclass(eq=False)  # identity: `capture` removes its own block from a stack of nested ones
class Compiles:
    cache_hits: int = 0
    cache_misses: int = 0
    backend_compiles: int = 0  # XLA compiles or persistent-cache loads
    lower_s: float = 0.0  # tracing to a jaxpr and lowering it to StableHLO
    compile_s: float = 0.0  # XLA's compile, or the load of a persistent-cache hit

    @property
    def source(self) -> str:
        """COMPILED when XLA compiled anything; HIT when every executable came from the persistent cache;
        IN_MEMORY when nothing reached XLA (the jit already held the program)."""
        if self.backend_compiles > self.cache_hits:
            return COMPILED
        return HIT if self.cache_hits else IN_MEMORY

    def add(self, other: "Compiles") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_local = threading.local()
_install_lock = threading.Lock()
_installed = False


def _open() -> list[Compiles]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _on_event(event: str, **_: object) -> None:
    for c in _open():  # nested blocks each count what happened inside them
        if event == CACHE_HIT:
            c.cache_hits += 1
        elif event == CACHE_MISS:
            c.cache_misses += 1


def _on_duration(event: str, duration: float, **_: object) -> None:
    for c in _open():
        if event in (TRACE, LOWER):
            c.lower_s += duration
        elif event == BACKEND_COMPILE:
            c.backend_compiles += 1
            c.compile_s += duration


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            monitoring.register_event_listener(_on_event)
            monitoring.register_event_duration_secs_listener(_on_duration)
            _installed = True


@contextlib.contextmanager
def capture() -> Iterator[Compiles]:
    """The compiles that code in this block, in this thread, caused."""
    _install()
    c = Compiles()
    stack = _open()
    stack.append(c)
    try:
        yield c
    finally:
        stack.remove(c)
