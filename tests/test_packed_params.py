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


def test_every_leaf_starts_aligned():
    """A kernel may get a packed leaf as a slice in place: the Mosaic GPU custom call needs 256-byte aligned
    inputs. Odd sizes of every width (a 1-byte and a 4-byte dtype, bf16 between) and the padding stays out of
    the leaves."""
    u8, f32 = jnp.uint8, jnp.float32
    tree = {"a": jnp.arange(3, dtype=u8), "b": jnp.ones((5, 7), jnp.bfloat16), "c": jnp.arange(9, dtype=u8),
            "d": jnp.full((3,), 2.0, f32), "e": jnp.arange(1, dtype=f32), "f": jnp.ones((1,), jnp.bfloat16)}
    packed = packed_params.pack(tree)
    assert len(packed.packs) == 3 and not packed.big
    for slot in packed.slots:
        _, i, offset, _ = slot
        assert offset * packed.packs[i].dtype.itemsize % packed_params.ALIGN == 0, slot
    _leaves_equal(packed_params.unpack(packed), tree)
    _leaves_equal(jax.jit(packed_params.unpack)(packed), tree)


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


def test_site_check_tells_rounding_from_a_misread():
    """tests/packed_sites.py's verdict, which the GPU test of the fused site kernels packed or not relies
    on (tests/test_engine_gpu.py): the tiny preset's blocks from a packed tree pass it, and the same with every
    packed buffer shifted by one element (each small operand read one place off) fail it."""
    from packed_sites import block_params, compare, within_rounding

    from dsv41 import model

    cfg = preset("tiny")
    core = block_params(P.init_params(cfg, seed=0))
    # three blocks (the stack's attention is a stand-in, so the layers differ only in their MoE and mHC
    # parameters): a misread moves every token from the first block on, and three compile in a third of eight's time
    core = {**core, "layers": core["layers"][:3]}
    packed = packed_params.pack(core)
    misread = packed_params.PackedParams(packed.big, tuple(jnp.roll(p, 1) for p in packed.packs), packed.treedef,
                                         packed.slots)
    assert within_rounding(compare(core, packed, 16, cfg, model.Sites()), 16)
    assert not within_rounding(compare(core, misread, 16, cfg, model.Sites()), 16)
