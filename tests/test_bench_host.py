"""scripts/bench_host.py: a decode step's host time by function, with the engine's programs stubbed."""

import pytest

import bench_host
import tiny_engine

pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)


def test_own_time_leaves_out_the_callees(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bench_host.time, "perf_counter", lambda: clock[0])
    att = bench_host.Attribution()

    def tick(dt):
        clock[0] += dt

    inner = att.wrap("inner", lambda: tick(2.0))
    outer = att.wrap("outer", lambda: (tick(1.0), inner(), tick(0.5)))
    outer()
    inner()
    assert att.own == {"inner": 4.0, "outer": 1.5}


def test_host_step_runs_every_part_without_the_device():
    """Two rows at a 100-token context: every part of the step is attributed (times on a loaded CI host are not
    compared), and the engine gets its programs and methods back."""
    eng = tiny_engine.make()
    programs = eng.programs
    r = bench_host.host_step(eng, 2, 100, steps=20)
    assert set(bench_host.PARTS) <= set(r) and all(r[p] >= 0 for p in bench_host.PARTS) and r["step_us"] > 0
    assert r["_rows"] > 0 and r["_batch"] > 0  # the Engram rows and batch arrays were built
    assert eng.programs is programs and "_batch" not in vars(eng)
    assert eng.counters["decode_steps"] >= 40


def test_host_step_with_tokens_fed_on_the_device():
    """The device feed's loop: its own parts attributed, no Engram rows built on the host."""
    eng = tiny_engine.make(device_feed=True)
    r = bench_host.host_step(eng, 2, 100, steps=20, fed=True)
    assert all(r[p] > 0 for p in bench_host.FED_PARTS) and "_rows" not in r and "_decode_batch" not in r
    assert "_fed_batch" not in vars(eng) and eng.counters["decode_steps"] >= 40
