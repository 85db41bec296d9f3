"""Compiled programs kept on disk and loaded at start-up without tracing them again (`ProgramStore`), and an
engine's executables by call signature (`Executables`).

Why: jax's persistent compilation cache keys an executable on its lowered program, so a restart must trace and lower
every program before it can look one up, and tracing is most of a warm start: 12.6 s for the bench preset's decode
program alone on the H200's host (docs/PERFORMANCE.md, section 6). The store keys
an executable on what determines the program instead: its name and static arguments, the abstract signature of
every argument (tree structure, shapes, dtypes, weak types, shardings and their devices), the source of the packages
that trace it (dsv41, pallas_kernels, serving/engine), jax's and jaxlib's versions, the backend and its devices,
XLA_FLAGS and the jax options that change a lowering (`key`). An argument that has no stable description (an object
printed with its address) makes the program unkeyable: it is compiled, not stored.

Entries are jax's serialized executables (`jax.experimental.serialize_executable`), one file each, written whole
(a temporary file renamed) beside jax's cache (`default_store`). Like jax's cache, the
directory must be trusted: loading an entry runs what it holds. Engines of several processes (one mesh over
hosts) keep their programs with jit and store none.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
import threading
import types
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_TRACED_PACKAGES = ("dsv41", "pallas_kernels", "serving.engine")
# jax options that change what a program traces or lowers to (the compilation cache's own options do not)
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl", "jax_threefry_partitionable",
                "jax_use_shardy_partitioner", "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion")


class Unkeyable(Exception):
    """An argument with no description that is the same in every process."""


def describe(x: Any) -> Any:
    """x as plain data (strings, numbers, tuples) equal across processes exactly when x is: frozen dataclasses by
    class and fields, functions by module and name, shardings with their device ids, arrays by shape, dtype, weak
    type and sharding. Raises `Unkeyable` for anything else whose repr holds an address."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if isinstance(x, (tuple, list)):
        return type(x).__name__, tuple(describe(v) for v in x)
    if isinstance(x, dict):
        return "dict", tuple((describe(k), describe(v)) for k, v in sorted(x.items(), key=lambda kv: repr(kv[0])))
    if isinstance(x, (frozenset, set)):
        return "set", tuple(sorted(repr(describe(v)) for v in x))
    if isinstance(x, (np.dtype, type)) and not dataclasses.is_dataclass(x):
        return "type", f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', str(x))}"
    if isinstance(x, jax.tree_util.PyTreeDef):
        return "treedef", str(x)
    if isinstance(x, jax.sharding.NamedSharding):
        return ("named", tuple(x.mesh.shape.items()), x.mesh.device_ids.tolist(), str(x.spec), x.memory_kind)
    if isinstance(x, jax.sharding.Sharding):
        return ("sharding", type(x).__name__, tuple(d.id for d in x._device_assignment), x.memory_kind)
    if isinstance(x, jax.sharding.Mesh):
        return "mesh", tuple(x.shape.items()), x.device_ids.tolist()
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        s = x.sharding
        committed = getattr(x, "committed", True)  # a ShapeDtypeStruct with a sharding stands for a placed array
        return ("array", x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)),
                describe(s) if s is not None and committed else None)
    if isinstance(x, (np.ndarray, np.generic)):
        return "host", x.shape, str(x.dtype)
    if isinstance(x, functools.partial):
        return "partial", describe(x.func), describe(x.args), describe(x.keywords)
    if hasattr(x, "__wrapped__"):  # jax.jit, functools.wraps: what they wrap (a partial's arguments included)
        return "wrapped", describe(x.__wrapped__)
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType)):
        name = f"{x.__module__}.{x.__qualname__}"
        if "<locals>" in name or "<lambda>" in name:
            raise Unkeyable(name)
        return "function", name
    if dataclasses.is_dataclass(x):
        return (type(x).__module__ + "." + type(x).__qualname__,
                tuple((f.name, describe(getattr(x, f.name))) for f in dataclasses.fields(x)))
    r = repr(x)
    if " at 0x" in r:
        raise Unkeyable(r)
    return type(x).__qualname__, r


@functools.cache
def code_digest() -> str:
    """A digest of every Python source file of the packages that trace the programs."""
    h = hashlib.sha256()
    for name in _TRACED_PACKAGES:
        root = pathlib.Path(__import__(name, fromlist=["_"]).__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def environment() -> tuple:
    """What outside the program's code and arguments changes the executable."""
    devices = jax.devices()
    return (jax.__version__, jaxlib.__version__, jax.default_backend(), devices[0].client.platform_version,
            tuple(d.device_kind for d in devices), jax.process_count(), os.environ.get("XLA_FLAGS", ""),
            tuple((o, str(getattr(jax.config, o, None))) for o in _JAX_OPTIONS))


def key(name: str, args: tuple, kwargs: dict, compiler_options: dict | None = None) -> str:
    """The store key of program `name` called as fn(*args, **kwargs) (kwargs: its static arguments)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    desc = (name, code_digest(), environment(), describe(tree), tuple(describe(x) for x in leaves),
            describe(kwargs), describe(compiler_options or {}))
    return hashlib.sha256(repr(desc).encode()).hexdigest()


def engine_key(cfg: Any, config: Any) -> str:
    """What names one engine's set of programs in the store: the model config and the engine options, but for those
    that do not change a program (how many compile workers, whether the store is used)."""
    return key("engine", (), {"cfg": cfg, "config": dataclasses.replace(config, compile_workers=0, program_store=True)})


def call_signature(args: tuple, kwargs: dict) -> tuple:
    """What tells an engine's calls of one program apart (its parameters and pool are the same in every call):
    the static arguments, and the kinds (host or device array, scalar), shapes and dtypes of the other arguments.
    A call an executable was not compiled for then finds none and goes through jit, rather than failing."""
    leaves = jax.tree_util.tree_leaves(args[2:])
    return (tuple(sorted(kwargs.items(), key=lambda kv: kv[0])),
            tuple((type(x), np.shape(x), getattr(x, "dtype", None)) for x in leaves))


STORE_SUBDIR = "dsv41-programs"


def default_store() -> "ProgramStore | None":
    """The program store beside jax's persistent compilation cache (`serving.compilation_cache`), or None: no cache
    configured, or a remote one."""
    d = jax.config.jax_compilation_cache_dir
    if not (jax.config.jax_enable_compilation_cache and d) or "://" in d:
        return None
    return ProgramStore(os.path.join(d, STORE_SUBDIR))


class ProgramStore:
    """Serialized executables in a directory, by `key`, at most max_bytes of them: a new entry evicts the least
    recently used ones (each code change keys every program anew, and the old entries are never read again)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 32 << 30):
        self.dir = pathlib.Path(directory)
        self.max_bytes = max_bytes

    def _path(self, k: str) -> pathlib.Path:
        return self.dir / f"{k}.exe"

    def has(self, k: str) -> bool:
        return self._path(k).exists()

    def _manifest(self, engine_key: str) -> pathlib.Path:
        return self.dir / f"{engine_key}.programs"

    def record_engine(self, engine_key: str, keys: list[str]) -> None:
        """Notes that an engine (`engine_key`) warms up exactly these programs, every one of them stored."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._manifest(engine_key).write_text("\n".join(keys) + "\n")
        except OSError as e:
            log.warning("program store: could not record the engine's programs (%s)", e)

    def holds_engine(self, engine_key: str) -> bool:
        """Whether every program an engine recorded (`record_engine`) is still stored."""
        try:
            keys = self._manifest(engine_key).read_text().split()
        except OSError:
            return False
        return bool(keys) and all(self.has(k) for k in keys)

    def load(self, k: str):
        """The stored executable (a `jax.stages.Compiled`), or None: none stored, or it could not be loaded (a
        warning; it is compiled again and stored over)."""
        path = self._path(k)
        try:
            blob = path.read_bytes()
            os.utime(path)  # used: the last to be evicted
        except FileNotFoundError:
            return None
        try:
            payload, in_tree, out_tree, device_ids = pickle.loads(blob)
            by_id = {d.id: d for d in jax.devices()}
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             execution_devices=[by_id[i] for i in device_ids])
        except Exception as e:  # a corrupt or foreign entry costs a compile, not the start-up
            log.warning("program store: %s could not be loaded (%s: %s); compiling it again", path.name,
                        type(e).__name__, e)
            return None

    def save(self, k: str, compiled) -> None:
        """Stores a compiled program; a program jax cannot serialize, or a write that fails, is logged and left out
        (the store is an optimization)."""
        try:
            # the devices it runs on, in order (loaded without them it would span every device of the backend)
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            blob = pickle.dumps((*serialize_executable.serialize(compiled), device_ids))
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, self._path(k))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._evict()
        except Exception as e:
            log.warning("program store: could not store %s (%s: %s)", k, type(e).__name__, e)

    def _evict(self) -> None:
        entries = []
        for p in self.dir.glob("*.exe"):
            try:
                st = p.stat()
            except FileNotFoundError:  # another process evicted it
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):  # least recently used first
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            log.info("program store: evicted %s (%.1f MB; the store keeps at most %.1f GB)", p.name, size / 1e6,
                     self.max_bytes / 1e9)


class Executables:
    """One engine's compiled programs, by program and `call_signature`: a call that finds its executable here runs it
    as it is (no tracing, no cache lookup)."""

    def __init__(self, store: ProgramStore | None = None):
        self.store = store
        self._by_call: dict[tuple, Any] = {}
        self._lock = threading.Lock()  # warm-up's compile threads keep executables at once

    def get(self, name: str, signature: tuple):
        return self._by_call.get((name, signature))

    def put(self, name: str, signature: tuple, compiled) -> None:
        with self._lock:
            self._by_call[(name, signature)] = compiled

    def __len__(self) -> int:
        return len(self._by_call)
