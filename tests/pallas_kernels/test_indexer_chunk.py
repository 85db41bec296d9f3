"""Tests of the prefill-chunk indexer kernel (pallas_kernels/indexer_chunk).

CPU: the Mosaic GPU kernel in the interpreter against `chunk_scores_reference` (dsv41.indexer.raw_scores and the
visibility mask). The interpreter fills outputs with NaN before a kernel runs, so a visible score the kernel
fails to write shows as NaN. One test lowers the kernel for CUDA at Flash's shapes; the GPU tests (marked `gpu`)
run it there against the reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexer_chunk as ic


def inputs(seed, B, S, IH, ID, G, *, exact):
    """Fresh random queries, head weights, keys; exact: values on a coarse grid, where every dot product and
    head sum is exact in float32 whatever the summation order (then the kernel equals the reference bit for
    bit)."""
    rng = np.random.default_rng(seed)
    if exact:
        draw = lambda *shape: jnp.asarray(rng.integers(-4, 5, shape) / 4.0, jnp.bfloat16)  # noqa: E731
    else:
        draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    return draw(B, S, IH, ID), draw(B, S, IH), draw(B, G, ID), rng


def run(q, w, k, nvis, **kw):
    return jax.jit(functools.partial(ic.chunk_scores, interpret=True, **kw))(q, w, k, nvis)


# one program: eagerly, the reference's einsums and masks are a dozen small compiles (~40 ms each on the CPU)
reference = jax.jit(ic.chunk_scores_reference)


def check(out, ref, exact):
    out, ref = np.asarray(out), np.asarray(ref)
    assert not np.isnan(out).any(), "a visible score was not written"
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    if exact:
        np.testing.assert_array_equal(out, ref)
    else:  # equal, or a bf16 ulp apart where a different float32 summation order crosses a rounding point
        fin = np.isfinite(ref)
        np.testing.assert_allclose(out[fin], ref[fin], rtol=2 ** -7, atol=1e-30)


@pytest.mark.parametrize("B,S,IH,ID,G,splits,exact", [
    (2, 37, 16, 64, 300, None, True),     # 16 queries a group, 2 blocks + padding; G not a multiple of the tile
    (1, 20, 32, 128, 130, None, False),   # Flash's head shape: 8 queries a group, 2 blocks, random data
    (1, 9, 64, 64, 256, 2, True),         # 4 queries a group, key splits
    (2, 5, 128, 64, 200, 4, True),        # 2 queries a group (IH = 128): the whole chunk in one block, 4 splits
])
def test_kernel_matches_reference(B, S, IH, ID, G, splits, exact):
    q, w, k, rng = inputs(B * 100 + S, B, S, IH, ID, G, exact=exact)
    nvis = rng.integers(0, G + 1, (B, S)).astype(np.int32)
    nvis[0, 0], nvis[-1, -1] = 0, G                  # a query that sees nothing, one that sees every key
    nvis = jnp.asarray(nvis)
    out = run(q, w, k, nvis, num_splits=splits)
    assert out.shape == (B, S, G)
    check(out, reference(q, w, k, nvis), exact)


def test_causal_chunk_skips_tiles_no_query_sees():
    """A chunk at the start of a sequence (entries visible grow with the position), a row whose queries see
    nothing, and one whose queries see one key of a second tile: the blocks' tiles beyond their last visible
    key are not computed, everything visible is."""
    B, S, IH, ID, G = 3, 40, 16, 64, 512
    q, w, k, _ = inputs(5, B, S, IH, ID, G, exact=True)
    nvis = jnp.asarray([np.arange(S) * 5 // 2, np.zeros(S), np.full(S, 65)], jnp.int32)
    out = run(q, w, k, nvis, num_splits=2)
    check(out, reference(q, w, k, nvis), True)
    assert np.isneginf(np.asarray(out)[1]).all()


def test_limits_are_reported():
    q, w, k, _ = inputs(0, 1, 4, 12, 64, 64, exact=True)
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        ic.chunk_scores(q, w, k, jnp.zeros((1, 4), jnp.int32), interpret=True)
    q, w, k, _ = inputs(0, 1, 4, 16, 32, 64, exact=True)
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        ic.chunk_scores(q, w, k, jnp.zeros((1, 4), jnp.int32), interpret=True)


def test_kernel_lowers_for_cuda_at_flash_shapes():
    """Pallas -> Mosaic GPU lowering (layouts, the per-query column slices, shared memory) at a 2048-token chunk
    over 32K entries, on the CPU."""
    sds = jax.ShapeDtypeStruct
    for B, S, G in ((1, 2048, 32768), (2, 100, 1000)):
        low = jax.jit(ic.chunk_scores).trace(sds((B, S, 32, 128), jnp.bfloat16), sds((B, S, 32), jnp.bfloat16),
                                             sds((B, G, 128), jnp.bfloat16), sds((B, S), jnp.int32))
        assert "indexer_chunk" in low.lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("S,G,exact", [(2048, 8192, True), (2048, 32768, False), (300, 4096, False)])
def test_gpu_flash(S, G, exact):
    """Flash's indexer (32 heads x 128) over a chunk at the end of a long context (every key visible to all but
    the chunk's own newest) and, at S = 300, a chunk at the start (causal growth)."""
    q, w, k, _ = inputs(S + G, 1, S, 32, 128, G, exact=exact)
    if S == 2048:
        nvis = jnp.asarray(G - S // 2 + jnp.arange(S)[None] // 2, jnp.int32)
    else:
        nvis = jnp.asarray(jnp.arange(S)[None] * G // S, jnp.int32)
    out = jax.jit(ic.chunk_scores)(q, w, k, nvis)
    check(out, reference(q, w, k, nvis), exact)
