"""The kernel tests' compiles all go to the persistent compilation cache (tests/conftest.py's floor, 1 s, holds for
the rest of the suite).

Each of these tests jits its kernel, reference and input builders for its own shapes, and xdist spreads a file's
tests over both workers, so the same small programs (most under the 1 s floor) compile again in the other worker
and in later tests. Stored whatever their compile time, they are loaded instead: from an empty cache on a 2-core
host these files took ~25% less test time (342 s -> 260 s). The rest of the suite keeps the floor: without it
there, the engine tests' many tiny eager compiles were written and not read back, and the suite as a whole got no
faster."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _cache_every_compile():
    floors = [(name, getattr(jax.config, name)) for name in ("jax_persistent_cache_min_compile_time_secs",
                                                             "jax_persistent_cache_min_entry_size_bytes")]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    yield
    for name, value in floors:
        jax.config.update(name, value)
