"""serving/engine/packed_params.py: small parameter arrays packed into per-dtype buffers and sliced back."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv41 import params as P
from dsv41.config import preset
from serving.engine import packed_params


def _leaves_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_eager_and_jitted():
    """The release formats' tree (FP8 weights with their scale blocks, FP4 experts, norms, biases): every leaf
    back bit for bit, eagerly and inside a program; far fewer arrays to pass."""
    params = P.init_params(preset("tiny"), seed=3)
    packed = packed_params.pack(params)
    n_before = len(jax.tree.leaves(params))
    assert packed.num_arrays < n_before // 2, (packed.num_arrays, n_before)
    assert len(jax.tree.leaves(packed)) == packed.num_arrays
    assert len(packed.packs) == len({p.dtype for p in packed.packs})  # one buffer per dtype
    _leaves_equal(packed_params.unpack(packed), params)
    _leaves_equal(jax.jit(packed_params.unpack)(packed), params)
    assert packed_params.pack(packed) is packed
    assert packed_params.unpack(params) is params  # a plain tree passes through


def test_large_and_sharded_leaves_stay_arrays():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    sharded = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, PartitionSpec("x")))
    replicated = jax.device_put(jnp.ones(8, jnp.bfloat16), NamedSharding(mesh, PartitionSpec()))
    tree = {"big": jnp.zeros((300, 300)), "sharded": sharded, "small": jnp.arange(5, dtype=jnp.int32),
            "replicated": replicated}
    packed = packed_params.pack(tree, max_bytes=4096)
    kinds = dict(zip(sorted(tree), (s[0] for s in packed.slots)))  # dict leaves flatten in key order
    assert kinds == {"big": "big", "replicated": "pack", "sharded": "big", "small": "pack"}
    _leaves_equal(packed_params.unpack(packed), tree)
