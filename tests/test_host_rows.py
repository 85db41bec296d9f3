import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from serving.engine import host_rows


def test_rows_pack_and_unpack_every_dtype_bit_for_bit():
    rng = np.random.default_rng(0)
    B = 3
    arrays = [rng.integers(-2**31, 2**31, (B, 5), dtype=np.int32), rng.integers(0, 2**32, (B, 2), dtype=np.uint32),
              rng.standard_normal((B,)).astype(np.float32), rng.random((B, 2, 2)) > 0.5,
              rng.standard_normal((B, 4, 3)).astype(ml_dtypes.float8_e4m3fn),
              rng.integers(0, 256, (B, 7), dtype=np.uint8), rng.standard_normal((B, 3)).astype(ml_dtypes.bfloat16),
              rng.integers(0, 9, (B, 100), dtype=np.int32)]
    rows = host_rows.pack(arrays)
    # each array starts 256-byte aligned in a row: with one row XLA may hand that range to a Mosaic GPU kernel
    assert rows.data.shape == (B, host_rows.ALIGN * (len(arrays) + 1)) and rows.data.dtype == np.uint8
    out = jax.jit(host_rows.unpack)(rows)
    for a, o in zip(arrays, out):
        assert o.dtype == a.dtype and o.shape == a.shape
        np.testing.assert_array_equal(np.asarray(o).view(np.uint8), a.view(np.uint8))


def test_split_packs_only_host_rows_and_join_restores_the_arguments():
    B = 2
    dev = jnp.ones((B, 3))
    big = np.ones((B, host_rows.MAX_ROW_BYTES + 1), np.uint8)
    args = ({"t": np.arange(B * 4, dtype=np.int32).reshape(B, 4), "d": dev, "n": None},
            [np.zeros(5, np.float32), np.array([True, False]), big], 7)
    rows, rest, layout = host_rows.split(args)
    assert len(rows.fields) == 2  # the [B, 4] tokens and the [B] mask; [5] has another leading axis
    assert len(rest) == 4  # dev, the [5] array, the large rows, the int
    back = jax.jit(host_rows.join, static_argnums=2)(rows, rest, layout)
    flat, want = jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(args)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(args)
    for a, b in zip(flat, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
