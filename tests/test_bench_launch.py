"""scripts/bench_launch.py: the decode program called as the engine calls it and with the same device buffers."""

import pytest

import bench_launch
import tiny_engine

pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)


def test_both_calls_run_the_same_step():
    """Two rows at a 100-token context on the shared tiny engine (its compiled decode program): both ways give
    the same logits (`measure` asserts it) and a time each, the queued calls' too."""
    eng = tiny_engine.make()
    fresh, same, queued, first = bench_launch.measure(eng, 2, 100, reps=2, blocks=1)
    assert fresh > 0 and same > 0 and queued > 0 and first > 0
