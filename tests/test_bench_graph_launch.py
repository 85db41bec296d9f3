"""scripts/bench_graph_launch.py: the chains it times compute what they say (the GPU numbers: the script)."""

import jax
import jax.numpy as jnp
import numpy as np

import bench_graph_launch as g


def test_xla_chain_is_its_steps_and_is_timed_both_ways():
    x = jnp.ones((1, g.DIM), jnp.bfloat16)
    fn = g.xla_chain(3)
    want = np.ones((1, g.DIM), np.float32)
    for i in range(3):
        for j in range(2):
            want = (want * (1.0 + 1e-3 * j) + 1e-3 * i).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_allclose(np.asarray(fn(x, None), np.float32), want, rtol=1e-2)
    for keep in (False, True):
        host, wall = g.measure(fn, x, None, reps=2, keep=keep)
        assert 0 < host <= wall
    assert len(jax.make_jaxpr(fn)(x, None).jaxpr.eqns) == 1  # one jitted call: the chain is one program
