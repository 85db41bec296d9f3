import dataclasses
import functools
import types

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


def _pinned(jaxpr) -> set:
    """The values a traced function's top level takes out of an optimization barrier."""
    return {v for e in jaxpr.eqns if e.primitive.name == "optimization_barrier" for v in e.outvars}


def test_join_pins_the_unpacked_arrays():
    """The program reads each unpacked array from the barrier's output, materialized at a fixed place in XLA's
    temporary buffer, never the packed buffer itself, whose address changes between calls (`host_rows.pinned`)."""
    args = (np.arange(6, dtype=np.int32).reshape(2, 3), np.array([1.5, 2.5], np.float32), jnp.ones(4))
    rows, rest, layout = host_rows.split(args)
    jaxpr = jax.make_jaxpr(lambda r, s: host_rows.join(r, s, layout))(rows, rest).jaxpr
    out = jaxpr.outvars
    assert out[0] in _pinned(jaxpr) and out[1] in _pinned(jaxpr)
    assert out[2] is jaxpr.invars[-1]  # a device array passes as it is


def test_a_fed_step_pins_what_it_resolves_from_the_feed():
    """A fed step's tokens, positions and lengths are computed from the step before's outputs (another address each
    step); the layers read them pinned, not recomputed from the feed in every fusion that uses them."""
    from serving.engine import programs

    B, T, k = 2, 7, 5
    i32 = functools.partial(np.zeros, dtype=np.int32)
    b = programs.Batch(tokens=i32((B, T)), pos0=i32(B), n_valid=i32(B), slot=i32(B), block_table=i32((B, 4)),
                       write_lo=i32(B), ring_lo=i32((B, 2)), rows=[])
    spec = programs.SpecFeed(out=i32((B, k + 1)), accepted=i32(B), drafts=i32((B, k)), n_next=i32(B),
                             first=i32(B), index=i32(B), first_index=i32(B), first_col=i32(B), history=i32((B, 2)))
    plain = programs.Feed(prev=i32(B), first=i32(B), index=i32(B), history=i32((B, 2)))
    cfg = types.SimpleNamespace(engram_layer_ids=())  # no Engram rows: the tables are not part of this

    def spec_fed(b):
        r, n_verify = programs._spec_fed({}, b, cfg, jnp.zeros(B, jnp.int32), engram_rows=False)
        return r.tokens, r.pos0, r.n_valid, n_verify

    jaxpr = jax.make_jaxpr(spec_fed)(dataclasses.replace(b, feed=spec)).jaxpr
    assert all(v in _pinned(jaxpr) for v in jaxpr.outvars[:3])
    jaxpr = jax.make_jaxpr(lambda b: programs._fed({}, b, cfg).tokens)(dataclasses.replace(b, feed=plain)).jaxpr
    assert jaxpr.outvars[0] in _pinned(jaxpr)
