"""scripts/bench_dispatch.py: each tail op computes what its name says, after the GEMM chain (the GPU numbers: the
script, `bash scripts/h200_checks.sh dispatch`)."""

import jax
import jax.numpy as jnp
import numpy as np

import bench_dispatch as d


def test_tails_compute_their_ops_and_the_calls_are_timed():
    lg = jax.random.normal(jax.random.key(1), (3, 50), jnp.float32)
    best = np.argmax(np.asarray(lg), -1)
    ops = d.tails(4)
    np.testing.assert_array_equal(ops["argmax"](lg, None), best)
    np.testing.assert_array_equal(ops["argsort"](lg, None), best)
    np.testing.assert_array_equal(ops["lax.top_k 4"](lg, None), best)
    np.testing.assert_allclose(ops["sort"](lg, None), np.max(np.asarray(lg), -1))
    np.testing.assert_allclose(ops["sort, one row"](lg, None), np.max(np.asarray(lg), -1)[:1])
    drawn = ops["categorical"](lg, jax.random.key(2))
    assert drawn.shape == (3,) and np.all((0 <= drawn) & (drawn < 50))
    # the sorted softmax's cumulative mass just before its last (largest) entry: 1 - that entry's probability
    top = np.max(np.asarray(jax.nn.softmax(lg, -1)), -1)
    np.testing.assert_allclose(ops["cumsum of sorted"](lg, None), 1 - top, rtol=1e-5)
    x, w = jnp.ones((8, 4096), jnp.bfloat16), jnp.eye(4096, dtype=jnp.bfloat16) / 2
    head = jnp.ones((4096, 50), jnp.bfloat16)
    f = d.program(ops["argmax"], gemms=2, rows=3)
    assert f(x, w, head, None).shape == (3,)
    call, total, second = d.call_and_result_s(f, (x, w, head, None), reps=2)
    assert 0 < call <= total and second > 0
