"""Radix-select top-k (dsv41/topk.py) against lax.top_k: the same positions, ties to the lower position.

Each test's selections run as jitted programs: eagerly, radix select's passes are dozens of small programs, each
an XLA compile (~40 ms on the CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import topk


def _lax_positions(x, k):
    return np.sort(np.asarray(_lax_top_k(x, k)), axis=-1)


_lax_top_k = jax.jit(lambda x, k: jax.lax.top_k(x, k)[1], static_argnums=1)


@pytest.mark.parametrize("shape, k, levels", [
    ((3, 2, 700), 64, None),  # distinct values
    ((4, 513), 512, 7),  # heavy ties: 7 distinct values, the threshold value split across positions
    ((2, 50), 50, 3),  # k = N
    ((5, 40), 1, 2),
])
@pytest.mark.parametrize("variant", list(topk.RADIX_VARIANTS))
def test_same_positions_as_lax_top_k(shape, k, levels, variant):
    rng = np.random.default_rng(k)
    x = rng.standard_normal(shape).astype(np.float32) * 100
    if levels:
        x = np.round(x / 100 * levels / 3)
    x[..., ::7] = -np.inf  # invisible entries
    x[..., 3] = -0.0
    x[..., 4] = 0.0
    xj = jnp.asarray(x)
    got = np.asarray(jax.jit(topk.top_k_positions, static_argnums=(1, 2, 3))(xj, k, *topk.RADIX_VARIANTS[variant]))
    np.testing.assert_array_equal(got, _lax_positions(xj, k))


@pytest.mark.parametrize("n", [70, 1 << 16])
def test_placement_takes_the_lowest_ties(n):
    """positions_from_threshold: below 2^16 keys one scan counts the keys above and the ties (16 bits each),
    from 2^16 on two scans; either way every key above the k-th largest and the lowest positions tied with it."""
    rng = np.random.default_rng(n)
    x = jnp.asarray(np.round(rng.standard_normal((2, n)) * 2), jnp.float32)  # five or so values: ties everywhere
    k = n // 3
    got = _placed(x, k)
    np.testing.assert_array_equal(np.asarray(got), _lax_positions(x, k))


@functools.partial(jax.jit, static_argnums=1)
def _placed(x, k):
    keys = topk.order_keys(x)
    return topk.positions_from_threshold(keys, topk.kth_largest_key(keys, k), k)


def test_order_keys_preserve_order():
    v = np.array([-np.inf, -3e38, -1.5, -1e-45, -0.0, 0.0, 1e-45, 2.0, 3e38, np.inf], np.float32)
    keys = np.asarray(topk.order_keys(jnp.asarray(v))).astype(np.int64)
    assert np.all(np.diff(keys) >= 0) and keys[4] + 1 == keys[5]  # -0.0 just below +0.0


def test_indexer_topk_entries_same_with_either_method():
    """The indexer's selection (entry ids ascending, -1 padded) through radix select equals lax.top_k's, with
    invisible entries (-inf, id -1) and rows seeing fewer entries than k."""
    from pallas_kernels import indexer_logits as il

    rng = np.random.default_rng(0)
    B, S, N, k = 3, 2, 300, 64
    s = np.round(rng.standard_normal((B, S, N)) * 4).astype(np.float32)  # many ties
    visible = np.array([300, 40, 0])[:, None, None]
    g = np.where(np.arange(N)[None, None] < visible, np.arange(N)[None, None], -1).repeat(S, 1)
    s = np.where(g >= 0, s, -np.inf)
    sj, gj = jnp.asarray(s), jnp.asarray(g, jnp.int32)
    want, *got = jax.jit(lambda s, g: [il.topk_entries(s, g, k, method=m) for m in ("lax", *topk.RADIX_VARIANTS)])(
        sj, gj)
    for variant, ids in zip(topk.RADIX_VARIANTS, got):
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want), err_msg=variant)
    assert (np.asarray(want)[1, :, 40:] == -1).all() and (np.asarray(want)[2] == -1).all()


def test_auto_method_takes_radix_from_64_rows(monkeypatch):
    from pallas_kernels import indexer_logits as il

    calls = []
    real = topk.top_k_positions
    monkeypatch.setattr(il.topk, "top_k_positions", lambda x, k, *a: calls.append(x.shape) or real(x, k, *a))
    both = jax.jit(lambda s: (il.topk_entries(s, jnp.arange(100, dtype=jnp.int32), 10),
                              il.topk_entries(s, jnp.arange(100), 10, "lax")))  # traced once a shape: one call
    for rows in (il.RADIX_MIN_ROWS - 1, il.RADIX_MIN_ROWS):
        s = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 1, 100)), jnp.float32)
        got, want = both(s)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert calls == [(il.RADIX_MIN_ROWS, 1, 100)]


def test_auto_method_takes_the_threshold_kernel_only_where_timed(monkeypatch):
    """'auto' with a kernel backend: the threshold kernel in place of radix select (RADIX_MIN_ROWS to
    KERNEL_MAX_ROWS rows) from KERNEL_MIN_KEYS['radix'] scores and in place of lax.top_k (fewer rows) from
    KERNEL_MIN_KEYS['lax'] (the sizes the H200 timed it faster at); XLA's choice elsewhere or without kernels."""
    from pallas_kernels import indexer_logits as il

    calls = []
    monkeypatch.setattr(il.topk_select, "top_k_positions",
                        lambda x, k, **kw: calls.append(x.shape) or jax.lax.top_k(x, k)[1])
    wide, narrow, many = il.KERNEL_MIN_KEYS["lax"], il.KERNEL_MIN_KEYS["radix"], il.KERNEL_MAX_ROWS
    assert narrow < wide and il.RADIX_MIN_ROWS <= many
    cases = [(1, wide, True, True), (many, wide, True, True), (many, narrow, True, True),
             (1, wide - 8, True, False), (1, narrow, True, False), (many, narrow - 8, True, False),
             (many + 1, wide, True, False), (1, wide, False, False)]
    for rows, width, kernel_ok, _ in cases:
        # traced, not run: the choice is made while tracing, and the results are not what this test reads (run
        # eagerly, the radix passes over these widths were ~130 small compiles)
        jax.eval_shape(lambda s, e: il.topk_entries(s, e, 4, kernel_ok=kernel_ok),
                       jax.ShapeDtypeStruct((rows, 1, width), jnp.float32), jax.ShapeDtypeStruct((width,), jnp.int32))
    assert calls == [(rows, 1, width) for rows, width, _, kernel in cases if kernel]
