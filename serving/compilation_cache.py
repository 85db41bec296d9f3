"""The persistent compilation cache of `dsv41 serve` and `dsv41 generate`: programs compiled once are loaded by
later runs (a restart of the tiny preset's server on the CPU goes from compiling every program to loading them).

On by default at ~/.cache/dsv41/jax-compilation-cache (or $DSV41_COMPILATION_CACHE; empty: off);
`--compilation-cache-dir DIR` moves it, `--no-compilation-cache` turns it off. Every program is kept, however
small: jax's defaults skip programs that compile in under a second, which are most of the CPU's."""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)

ENV = "DSV41_COMPILATION_CACHE"
DEFAULT_DIR = os.path.join("~", ".cache", "dsv41", "jax-compilation-cache")


def default_dir() -> str | None:
    """$DSV41_COMPILATION_CACHE (empty: no cache) or ~/.cache/dsv41/jax-compilation-cache."""
    path = os.environ.get(ENV, DEFAULT_DIR)
    return os.path.expanduser(path) if path else None


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                   help=f"persistent compilation cache: later runs load the programs compiled here instead of "
                        f"compiling them (default: ${ENV} or {DEFAULT_DIR})")
    g.add_argument("--no-compilation-cache", action="store_true",
                   help="compile every program at every start (no persistent compilation cache)")


def dir_from_args(args: argparse.Namespace) -> str | None:
    """The cache directory the flags ask for (None: off); the default where no flag was given."""
    if getattr(args, "no_compilation_cache", False):
        return None
    given = getattr(args, "compilation_cache_dir", None)
    return os.path.expanduser(given) if given else default_dir()


def configure(path: str | None) -> str | None:
    """Points jax's persistent compilation cache at `path` (None: turns it off) and keeps every program there.
    Call before the first compile: jax opens the cache once per process. -> path."""
    import jax

    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--compilation-cache-dir {path}: cannot create it ({e}); give a writable directory or "
                         "pass --no-compilation-cache") from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor, and none imposed
    log.debug("persistent compilation cache: %s", path)
    return path
