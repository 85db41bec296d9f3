"""scripts/bench_weight_layout.py: the layouts it streams hold exactly the boxes the row-major layout would give,
and its pipeline runs in the Mosaic GPU interpreter."""

import jax
import jax.numpy as jnp
import numpy as np

import bench_weight_layout as bwl


def test_tiles_and_flat_blocks_are_the_row_major_boxes():
    rows, box = 16, 64
    w = jax.random.bits(jax.random.key(1), (3 * rows, 4 * box), jnp.uint8)
    tiles, flat = np.asarray(bwl.to_tiles(w, rows, box)), np.asarray(bwl.to_flat(w, rows, box))
    wn = np.asarray(w)
    assert tiles.shape == (3, 4, rows, box) and flat.shape == (3, 4, rows * box // 1024, 256)
    for i in range(3):
        for k in range(4):
            want = wn[i * rows:(i + 1) * rows, k * box:(k + 1) * box]
            np.testing.assert_array_equal(tiles[i, k], want)
            assert flat[i, k].tobytes() == want.tobytes()


def test_stream_kernel_runs_in_the_interpreter():
    for layout, dtype in (("rows", jnp.uint8), ("tiles", jnp.uint8), ("flat", jnp.uint32)):
        fn, shape = bwl.stream_kernel(layout, 2, 128, 256, 128, 2, True)
        out = jax.block_until_ready(fn(jnp.zeros(shape, dtype)))
        assert out.shape == (8, 128)
