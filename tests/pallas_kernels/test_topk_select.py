"""Tests of the top-k threshold kernel (pallas_kernels/topk_select): the Mosaic GPU kernel in the interpreter
against `dsv41.topk.kth_largest_key` and the positions against lax.top_k (ties to the lower position), rows
held in registers and rows re-read from shared memory every pass; the indexer's `topk_entries` through it;
lowering for CUDA at the indexer's shapes. GPU tests are marked `gpu`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import topk
from pallas_kernels import indexer_logits as il
from pallas_kernels import topk_select as ts


def scores(seed, shape):
    """Fresh scores with many exact ties (bf16 values, as the indexer's), some -inf (invisible entries)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    # rounded on the host, as jnp.asarray(x, jnp.bfloat16) rounds: eagerly, each jnp conversion (and the staging
    # by jnp.asarray) is an XLA compile (~40 ms on the CPU) for each new shape
    x = x.astype(jnp.bfloat16).astype(np.float32)
    x[rng.random(shape) < 0.1] = -np.inf
    return jax.device_put(x)


def lax_positions(x, k):
    return np.sort(np.asarray(_lax_positions(x, k)), axis=-1)


# The references (and the kernels' calls) as jitted programs: eagerly, the radix reference's passes and the
# wrappers' array preparation are dozens of small programs, each an XLA compile (~40 ms on the CPU).
_lax_positions = jax.jit(lambda x, k: jax.lax.top_k(x, k)[1], static_argnums=1)


@functools.partial(jax.jit, static_argnums=1)
def keys_and_reference(x, k):
    """-> (topk.order_keys(x), the reference's k-th largest key of each row)."""
    keys = topk.order_keys(x)
    return keys, topk.kth_largest_key(keys, k)


def kernel(f, *args, **kw):
    """f(*args, interpret=True, **kw) (a topk_select function) as one jitted program, kw static."""
    return jax.jit(functools.partial(f, interpret=True, **kw))(*args)


@pytest.mark.parametrize("bf16_values", [False, True], ids=["32-passes", "bf16-16-passes"])
@pytest.mark.parametrize("shape,k", [
    ((3, 200), 37),        # one array of 256 keys (padded)
    ((2, 5000), 512),      # two chunks of 4096 (padded to 8192), held in registers
    ((1, 20000), 512),     # beyond REG_KEYS: the keys re-read from shared memory every pass
    ((2, 130), 130),       # k = N: every key, -inf ones too
])
def test_threshold_and_positions_match_the_references(shape, k, bf16_values):
    x = scores(shape[-1] + k, shape)
    keys, ref = keys_and_reference(x, k)
    t = kernel(ts.kth_largest_key, keys, k=k, bf16_values=bf16_values)
    np.testing.assert_array_equal(np.asarray(t), np.asarray(ref))
    pos = kernel(ts.top_k_positions, x, k=k, bf16_values=bf16_values)
    np.testing.assert_array_equal(np.asarray(pos), lax_positions(x, k))


def test_float32_scores_need_all_32_passes():
    """Scores that are not bf16 values, tied in their top 16 bits: 32 passes tell them apart, 16 do not. So the
    promise bf16_values matters, and the 32-pass mode cut short fails here (the bf16 data above cannot show
    it)."""
    x = jax.device_put(np.asarray([[1.0, 1.0 + 2 ** -20, 1.0 + 2 ** -19, 0.5]], np.float32))
    np.testing.assert_array_equal(np.asarray(kernel(ts.top_k_positions, x, k=1)), [[2]])
    keys = np.asarray(keys_and_reference(x, 1)[0])
    # (np.asarray first: eagerly, indexing a jax.Array is a small program)
    assert int(np.asarray(kernel(ts.kth_largest_key, keys, k=1))[0]) == int(keys[0, 2])
    # (the thresholds, not the positions: placed from a wrong threshold, the positions can be right by chance)
    assert int(np.asarray(kernel(ts.kth_largest_key, keys, k=1, bf16_values=True))[0]) != int(keys[0, 2])


def test_a_row_of_equal_scores_takes_the_lowest_positions():
    x = np.zeros((2, 300), np.float32)  # on the host: eagerly, each jnp op is a compile
    x[1, 7] = 1.0
    pos = np.asarray(kernel(ts.top_k_positions, jax.device_put(x), k=5))
    np.testing.assert_array_equal(pos, [[0, 1, 2, 3, 4], [0, 1, 2, 3, 7]])


def test_topk_entries_through_the_kernel_equals_lax():
    """The indexer's selection (entry ids ascending, -1 padded) with method='kernel' and with lax.top_k."""
    s = scores(3, (2, 3, 1000))
    g = np.where(np.isfinite(np.asarray(s)), np.arange(1000, dtype=np.int32), -1)
    got = kernel(il.topk_entries, s, g, k=64, method="kernel")
    want = jax.jit(functools.partial(il.topk_entries, k=64, method="lax"))(s, g)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("n,k", [(3000, 300), (40000, 30), (1500, 1000)])
def test_rows_longer_than_shared_memory_go_by_segments(monkeypatch, n, k):
    """MAX_KEYS cut to 1024 so that small rows take the long-row path: the k largest of each segment (the last one
    padded), then the threshold of those; twice where the gathered keys are still too many (40 x 30 = 1200);
    XLA's select where segmenting would not shrink the row (2 x 1000 >= 1500)."""
    monkeypatch.setattr(ts, "MAX_KEYS", 1024)
    x = scores(n + k, (2, n))
    keys, ref = keys_and_reference(x, k)
    t = kernel(ts.kth_largest_key, keys, k=k, bf16_values=True)
    np.testing.assert_array_equal(np.asarray(t), np.asarray(ref))


def test_limits():
    with pytest.raises(ValueError, match="k=0"):
        ts.kth_largest_key(jax.device_put(np.zeros((1, 10), np.uint32)), 0, interpret=True)


def test_kernel_lowers_for_cuda():
    """Pallas -> Mosaic GPU lowering (Lane semantics) at batch 64 x 16K candidates (keys in registers), at 32K
    keys (shared memory) and at 142K (a long row by segments), on the CPU."""
    sds = jax.ShapeDtypeStruct
    for n in (16384, 32768, 142000):
        low = jax.jit(functools.partial(ts.top_k_positions, k=512)).trace(sds((64, n), jnp.float32))
        assert "topk_threshold" in low.lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("bf16_values", [False, True])
@pytest.mark.parametrize("shape", [(1, 16384), (64, 16384), (8, 32768), (64, 1000), (2, 142000)])
def test_gpu_positions_equal_lax(shape, bf16_values):
    x = scores(shape[0], shape)
    k = min(512, shape[-1])
    pos = jax.jit(functools.partial(ts.top_k_positions, k=k, bf16_values=bf16_values))(x)
    np.testing.assert_array_equal(np.asarray(pos), lax_positions(x, k))
