"""The program store's keys and entries (`serving.engine.executables`); the engine's use of it end to end (a
restart loads every program, traces none, same tokens) is in tests/test_startup.py."""

from __future__ import annotations

import dataclasses
import logging
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41.config import preset
from dsv41.quant import Numerics
from serving.engine import executables as X
from serving.engine.backends import Backends


def test_describe_is_plain_data_and_refuses_addresses():
    cfg = preset("tiny")
    assert X.describe(cfg) == X.describe(dataclasses.replace(cfg))  # by value, not identity
    assert X.describe(cfg) != X.describe(dataclasses.replace(cfg, n_heads=4))
    assert "0x" not in repr(X.describe(Backends()))  # functions by module and name
    assert X.describe(np.zeros((2, 3), np.int32)) == ("host", (2, 3), "int32")
    for bad in (lambda x: x, object()):
        with pytest.raises(X.Unkeyable):
            X.describe(bad)

    def local(x):
        return x

    with pytest.raises(X.Unkeyable):
        X.describe(local)


def test_key_changes_with_whatever_changes_the_program():
    dev = jax.devices()
    x = jax.device_put(np.zeros((4, 8), np.float32), dev[0])
    base = X.key("p", (x, np.zeros(4, np.int32)), {"cfg": preset("tiny"), "num": Numerics()})
    assert base == X.key("p", (jnp.asarray(x), np.ones(4, np.int32)), {"num": Numerics(), "cfg": preset("tiny")})
    variants = [
        X.key("q", (x, np.zeros(4, np.int32)), {"cfg": preset("tiny"), "num": Numerics()}),  # another program
        X.key("p", (x, np.zeros(5, np.int32)), {"cfg": preset("tiny"), "num": Numerics()}),  # a shape
        X.key("p", (x.astype(jnp.bfloat16), np.zeros(4, np.int32)), {"cfg": preset("tiny"), "num": Numerics()}),
        X.key("p", ((x,), np.zeros(4, np.int32)), {"cfg": preset("tiny"), "num": Numerics()}),  # the tree
        X.key("p", (x, np.zeros(4, np.int32)), {"cfg": preset("tiny"), "num": Numerics(dtype="float32")}),
        X.key("p", (x, np.zeros(4, np.int32)), {"cfg": preset("tiny"), "num": Numerics()}, {"xla_opt": 1}),
    ]
    if len(dev) > 1:  # the device an argument is on
        variants.append(X.key("p", (jax.device_put(x, dev[1]), np.zeros(4, np.int32)),
                              {"cfg": preset("tiny"), "num": Numerics()}))
    assert len({base, *variants}) == len(variants) + 1


def _fresh_constant() -> float:
    """A constant no other run compiled: the test's program is compiled in this process, never loaded from the
    shared persistent cache (an executable loaded from it does not serialize again on the CPU, `Program.keep`)."""
    return float(np.random.default_rng().integers(1, 1 << 20))


def test_store_round_trip_on_the_devices_it_was_compiled_for(tmp_path):
    """An entry runs on the device its program was compiled for, not on every device of the backend."""
    dev = jax.devices()[-1]
    x = jax.device_put(np.arange(6, dtype=np.float32), dev)
    c = _fresh_constant()
    compiled = jax.jit(lambda a: a * 2 + c).lower(x).compile()
    store = X.ProgramStore(tmp_path / X.STORE_SUBDIR)
    store.save("k", compiled)
    loaded = store.load("k")
    out = loaded(x)
    assert out.devices() == {dev}
    np.testing.assert_array_equal(np.asarray(out), np.arange(6) * 2 + c)
    assert store.load("missing") is None


def test_a_corrupt_entry_is_compiled_again(tmp_path, caplog):
    store = X.ProgramStore(tmp_path)
    (tmp_path / "bad.exe").write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING, logger=X.__name__):
        assert store.load("bad") is None
    assert "could not be loaded" in caplog.text and "compiling it again" in caplog.text


def test_executables_by_program_and_call_signature():
    ex = X.Executables()
    args = (None, None, np.zeros((2, 5), np.uint8), (jnp.zeros(3),))
    sig = X.call_signature(args, {"layout": ("t",), "cfg": 1})
    ex.put("full", sig, "exe")
    assert ex.get("full", X.call_signature(args, {"cfg": 1, "layout": ("t",)})) == "exe"
    assert ex.get("decoder", sig) is None
    other = (None, None, np.zeros((4, 5), np.uint8), (jnp.zeros(3),))  # another batch size
    assert ex.get("full", X.call_signature(other, {"layout": ("t",), "cfg": 1})) is None


def test_store_round_trip_over_a_mesh_in_its_device_order(tmp_path):
    """A program over a mesh whose devices are not in id order loads onto those devices, in that order."""
    devs = jax.devices()
    if len(devs) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.sharding.Mesh(np.array([devs[3], devs[1]]), ("data",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.device_put(np.arange(8, dtype=np.float32), spec)
    c = _fresh_constant()
    compiled = jax.jit(lambda a: a * 3 + c, out_shardings=spec).lower(x).compile()
    store = X.ProgramStore(tmp_path)
    store.save("m", compiled)
    out = store.load("m")(x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(8) * 3 + c)
    assert [s.device.id for s in out.addressable_shards] == [3, 1]
    assert [(np.asarray(s.data) - c).tolist() for s in out.addressable_shards] == [[0, 3, 6, 9], [12, 15, 18, 21]]


def test_the_store_evicts_the_least_recently_used(tmp_path):
    import os

    compiled = jax.jit(lambda a: a + 1).lower(np.zeros(3, np.float32)).compile()
    store = X.ProgramStore(tmp_path)
    store.save("a", compiled)
    size = (tmp_path / "a.exe").stat().st_size
    store.max_bytes = 2 * size
    store.save("b", compiled)
    os.utime(tmp_path / "a.exe", (0, 0))
    os.utime(tmp_path / "b.exe", (1, 1))
    store.load("a")  # read: now the most recently used
    store.save("c", compiled)
    assert sorted(p.name for p in tmp_path.glob("*.exe")) == ["a.exe", "c.exe"]


def test_compile_workers_start_only_where_they_can_serve_the_engine(caplog, tmp_path):
    """`precompile.start` launches processes only for an engine of one process with a program store; `dsv41 serve`
    asks for them by default only where it warms up one GPU (`precompile.default_count`), and a flag overrides it."""
    import argparse

    from serving import cli_serve
    from serving.engine import precompile
    from serving.engine.config import EngineConfig
    from serving.engine.errors import EngineError

    assert precompile.default_count("cpu", 16) == 0
    assert [precompile.default_count("gpu", c) for c in (1, 2, 16, 128)] == [1, 1, 8, 8]
    cfg = preset("tiny")
    assert precompile.start(cfg, EngineConfig()) is None  # none asked
    with caplog.at_level(logging.WARNING, "serving.engine.precompile"):
        assert precompile.start(cfg, EngineConfig(compile_workers=2, program_store=False)) is None
    assert "the program store is off" in caplog.text
    with pytest.raises(EngineError, match="compile_workers"):
        EngineConfig(compile_workers=-1)
    # an engine on a mesh of this process gets them when asked (each builds the abstract engine on the same devices)
    with mock.patch.object(X, "default_store", lambda: X.ProgramStore(tmp_path)):
        started = precompile.start(cfg, EngineConfig(compile_workers=1, data_parallel_size=2))
    assert started is not None and len(started.procs) == 1
    started.stop()

    def workers(*flags):
        args = cli_serve.add_serve_args(argparse.ArgumentParser()).parse_args(["--preset", "tiny", *flags])
        return cli_serve.compile_workers(args, cli_serve.engine_kwargs(args))

    assert workers() == 0  # the CPU: none by default, warm-up or not
    assert workers("--warmup") == 0
    assert workers("--compile-workers", "3") == 3
    with pytest.raises(SystemExit, match="--compile-workers -1"):
        workers("--compile-workers", "-1")


def test_the_store_knows_when_it_holds_an_engines_programs(tmp_path):
    """`record_engine` / `holds_engine`: an engine whose programs are all stored needs no compile workers at its next
    start; one entry gone (evicted), and it does again. The engine key ignores the options that change no program."""
    from serving.engine.config import EngineConfig

    store = X.ProgramStore(tmp_path)
    cfg = preset("tiny")
    k = X.engine_key(cfg, EngineConfig(compile_workers=4, program_store=True))
    assert k == X.engine_key(cfg, EngineConfig()) != X.engine_key(cfg, EngineConfig(max_num_seqs=4))
    assert not store.holds_engine(k)
    for name in ("a", "b"):
        (tmp_path / f"{name}.exe").write_bytes(b"x")
    store.record_engine(k, ["a", "b"])
    assert store.holds_engine(k)
    (tmp_path / "b.exe").unlink()
    assert not store.holds_engine(k)


# a stand-in compile worker: reports its covering program, then the others only after the engine's GO
_WORKER = """
import json, sys, time
time.sleep(0.2 * int(sys.argv[1]))  # the second covering program comes late: nothing else may come before it
def report(kind, B):
    print(json.dumps(dict(kind=kind, B=B, T=1, pages=8, lower_s=0.0, compile_s=0.0, source="compiled")), flush=True)
report("decode", int(sys.argv[1]))
if sys.stdin.buffer.readline() == b"go\\n":
    report("encoder", int(sys.argv[1]))
"""


def test_compile_workers_go_past_the_covering_programs_once_each_is_reported():
    """`CompileWorkers.reports(first=...)`: the workers hold their other programs back (they wait for `GO` on stdin)
    until every covering program is reported, so that those compile alone; the engine's process gets each report
    once, and a second call goes on where the first stopped (a staged warm-up reads the rest in the background)."""
    import subprocess
    import sys

    from serving.engine import precompile

    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(B)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for B in (1, 2)]
    workers = precompile.CompileWorkers(procs)
    got = []
    for _, r in workers.reports(first={("decode", 1, 1, 8), ("decode", 2, 1, 8)}):
        got.append((r.kind, r.B))
        if len(got) == 2:
            break
    assert sorted(got) == [("decode", 1), ("decode", 2)] and not workers.done
    got += [(r.kind, r.B) for _, r in workers.reports()]
    assert sorted(got[2:]) == [("encoder", 1), ("encoder", 2)] and workers.done
    assert [p.returncode for p in procs] == [0, 0]


def test_a_compile_worker_tries_again_what_ran_out_of_gpu_memory(caplog):
    """A worker whose compile runs out of GPU memory (XLA's autotuning beside the server's pool and the other
    workers) compiles the programs it has not reported again, one at a time, after a wait; another error ends it."""
    from serving.engine import precompile_worker
    from serving.engine.warmup_progress import ProgramReport

    class Engine:
        def __init__(self, fail: str):
            self.fail, self.calls = fail, []

        def compile_programs(self, shapes, threads, on_ready, load):
            self.calls.append((list(shapes), threads))
            on_ready(ProgramReport(*shapes[0], 0.0, 0.0, "compiled"))
            if len(self.calls) == 1:
                raise RuntimeError(f"{self.fail}: Out of memory while trying to allocate 1.25GiB")
            for s in shapes[1:]:
                on_ready(ProgramReport(*s, 0.0, 0.0, "compiled"))

    shapes = [("decode", b, 1, 8) for b in (1, 2, 4)]
    eng, sent = Engine("RESOURCE_EXHAUSTED"), []
    with caplog.at_level(logging.WARNING):
        precompile_worker.compile_each(eng, shapes, lambda r: sent.append(r.B), wait_s=(0.0,))
    assert eng.calls == [(shapes, 2), (shapes[1:], 1)] and sent == [1, 2, 4]
    assert "out of GPU memory" in caplog.text
    with pytest.raises(RuntimeError, match="INTERNAL"):
        precompile_worker.compile_each(Engine("INTERNAL"), shapes, lambda r: None, wait_s=(0.0,))
