"""scripts/trace_gaps.py: the gap analysis on made-up timelines, and its trace reader on a real (CPU) profile."""

import glob
import os

import jax
import jax.numpy as jnp
import pytest
import tiny_engine

import trace_gaps as tg


def k(name, start, dur, cid=None):
    return tg.Kernel(name, float(start), float(dur), "Stream #7", {} if cid is None else {"correlation_id": cid})


def test_gaps_are_idle_stretches_with_their_neighbours():
    # two streams overlap: [0, 50) and [10, 20) leave no gap; then 10 ns idle, then 40 ns idle
    step = [k("fusion_1", 0, 50), k("fusion_2", 10, 10), k("mosaic_gpu_kernel", 60, 10), k("nvjet_gemm", 110, 10)]
    got = tg.gaps(step)
    assert [(g, a.name, b.name) for g, a, b in got] == [(10.0, "fusion_1", "mosaic_gpu_kernel"),
                                                       (40.0, "mosaic_gpu_kernel", "nvjet_gemm")]
    s = tg.summarize_step(step, launches={})
    assert s["wall_us"] * 1e3 == 120 and s["idle_us"] * 1e3 == 50 and s["busy_us"] * 1e3 == 70
    assert s["idle_by_next_kind_us"]["XLA GEMM (cuBLAS / Triton)"][0] == 1
    assert s["launch_wait_us"] == []


def test_launch_wait_is_kernel_start_after_its_launch_returned():
    step = [k("a", 1000, 10, cid=5), k("b", 3000, 10, cid=6)]
    s = tg.summarize_step(step, launches={5: 1000.0, 6: 1000.0})
    assert s["launch_wait_us"] == [0.0, 2.0]


def test_window_edges_are_the_time_outside_the_kernels():
    ks = [k("a", 100, 10), k("b", 120, 30), k("c", 1000, 10)]
    assert tg.window_edges(ks, [(0, 200), (500, 600), (900, 1050)]) == [(100.0, 50.0), (100.0, 40.0)]


def test_kernel_streams_by_name():
    # the names the H200's trace gave (2026-12-01): the compute stream also lists the copies it runs
    assert tg.is_kernel_stream("Stream #14(Memset,Compute,MemcpyD2H,MemcpyD2D)")
    assert tg.is_kernel_stream("Stream #7")
    assert not tg.is_kernel_stream("Stream #15(MemcpyH2D)")
    assert not tg.is_kernel_stream("XLA Ops")


def test_steps_split_by_host_windows_else_by_long_idle():
    ks = [k("a", 0, 10), k("b", 20, 10), k("c", 1000, 10), k("d", 1015, 10)]
    assert [[x.name for x in s] for s in tg.split_steps(ks, [(0, 500), (900, 1100)], 1e9)] == [["a", "b"],
                                                                                               ["c", "d"]]
    assert [[x.name for x in s] for s in tg.split_steps(ks, [], 500)] == [["a", "b"], ["c", "d"]]
    assert len(tg.split_steps(ks, [], 5000)) == 1


def test_reads_a_profile_and_its_step_marks(tmp_path):
    """On the CPU the trace has no GPU plane (no kernels), but the step annotations and the reader's use of
    jax.profiler.ProfileData are the same as on the GPU."""
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            with jax.profiler.TraceAnnotation(tg.STEP_MARK):
                f(x).block_until_ready()
    (path,) = glob.glob(os.path.join(tmp_path, "**", "*.xplane.pb"), recursive=True)
    kernels, launches, windows = tg.read_trace(path)
    assert kernels == [] and len(windows) == 3
    assert all(a < b for a, b in windows) and windows[0][1] <= windows[1][0]


@pytest.mark.xdist_group(tiny_engine.GROUP)
def test_host_profile_of_engine_steps(capsys):
    """The engine-step half of the script on the tiny preset (the XLA path on the CPU), with the engine tests'
    engine: its decode program is theirs, compiled once on their worker."""
    from bench_engine import fake_decode_state

    from serving.engine import programs

    eng = tiny_engine.make()
    fake_decode_state(eng, 1, 200)
    eng.step()
    b, s = eng.decode_inputs(list(eng.running.values()))

    def device_step():
        eng.pool, _, tok = programs.run_full(eng.params, eng.pool, b, s, **eng.static)
        tok.block_until_ready()

    tg.host_profile(eng, device_step, 2)
    out = capsys.readouterr().out
    assert "Engine.step" in out and "engine.py" in out and "(_decode)" in out
