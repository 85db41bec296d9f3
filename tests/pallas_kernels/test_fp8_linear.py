"""FP8 linear (release e4m3 + UE8M0 per 32x32 weights): kernel layout, K split, and the Mosaic GPU kernel in the
interpreter (CPU) against a float64 reference; GPU tests (marked `gpu`) run the compiled kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41.quant import Fp8Weight
from pallas_kernels import expert_gemm as eg
from pallas_kernels import fp8_linear as f8
from serving.engine import backends as BK
from host_arrays import put


def _random_fp8(rng, n, k, lo=112, hi=130):
    """Every e4m3 byte but NaN (0x7F / 0xFF), incl. -0 and subnormals, and a spread of scale bytes."""
    raw = rng.integers(0, 256, (n, k), dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    scale = rng.integers(lo, hi, (n // 32, k // 32), dtype=np.uint8)
    return Fp8Weight(put(raw.view(ml_dtypes.float8_e4m3fn)), put(scale))


# The kernels' calls and the XLA products as jitted programs: eagerly, their array preparation is dozens of small
# programs, each an XLA compile (~40 ms on the CPU): most of the interpreter tests' time. (prepare_fp8_linear stays
# eager: its scale-byte check reads concrete values.)
_fp8_linear = jax.jit(f8.fp8_linear)
_dequantize_f32 = jax.jit(lambda w: w.dequantize(jnp.float32))


def _ref64(x, w):
    return np.asarray(x).astype(np.float64) @ np.asarray(_dequantize_f32(w), np.float64).T


def _rel(a, b):
    a = np.asarray(a).astype(np.float64)  # bf16 / f32 -> f64: exact
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_prepare_roundtrip_and_decode_model():
    rng, num_splits = np.random.default_rng(2), 2
    w = _random_fp8(rng, 128, 512)
    p = f8.prepare_fp8_linear(w, num_splits=num_splits)
    assert p.weight.shape == (1, 128, 512) and p.shape == (128, 512) and p.splits == num_splits
    back = jax.jit(f8.unprepare_fp8_linear)(p)
    assert (np.asarray(back.weight).view(np.uint8) == np.asarray(w.weight).view(np.uint8)).all()
    assert (np.asarray(back.scale) == np.asarray(w.scale)).all()
    # the interpreter's model of the register decoder, tile by tile, equals dequantize in bf16
    dense = np.asarray(_dequantize_f32(w))
    tiles = _decoded_tiles(p.weight, p.scale_t)
    for r0 in (0, 64):
        for k0 in range(0, 512, 128):
            want = dense[r0:r0 + 64, k0:k0 + 128]
            np.testing.assert_array_equal(np.asarray(tiles[r0, k0]).astype(np.float32),
                                          want.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.asarray(_dequantize_f32(p)).tobytes() == dense.tobytes()


@jax.jit  # one program: eagerly, each tile's slices and decode are a dozen compiles
def _decoded_tiles(weight, scale_t):
    """{(r0, k0): eg._dequant_tile8_jnp of the 64 x 128 tile at rows r0, inputs k0} over a [1, N, K] weight."""
    return {(r0, k0): eg._dequant_tile8_jnp(weight[0, r0:r0 + 64, k0:k0 + 128],
                                            scale_t[0, k0 // 32:k0 // 32 + 4, r0:r0 + 64])
            for r0 in range(0, weight.shape[1], 64) for k0 in range(0, weight.shape[2], 128)}


def test_splits_give_every_sm_work():
    assert f8.splits(32768, 1280) == 1  # wq_b: 256 items already
    assert f8.splits(1280, 5120) == 10  # wq_a: 10 items -> 100 (4 steps of 128 each)
    assert f8.splits(5120, 8192) == 4  # wo_b: 40 -> 160
    assert f8.splits(2304, 5120) == 8  # shared expert w1/w3: 18 -> 144
    for n, k in [(1280, 5120), (512, 5120), (5120, 2304), (256, 256)]:
        s = f8.splits(n, k)
        assert (k // 128) % s == 0 and (s == 1 or k // 128 // s >= f8.MIN_STEPS)


def test_prepare_rejects():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="multiples of 128"):
        f8.prepare_fp8_linear(_random_fp8(rng, 96, 128))
    with pytest.raises(ValueError, match="scale byte"):
        f8.prepare_fp8_linear(_random_fp8(rng, 128, 128, lo=135, hi=136))
    with pytest.raises(ValueError, match="divide"):
        f8.prepare_fp8_linear(_random_fp8(rng, 128, 384), num_splits=2)
    p = f8.prepare_fp8_linear(_random_fp8(rng, 128, 128), interpret=True)
    with pytest.raises(ValueError, match="MAX_ROWS"):  # raised while tracing
        _fp8_linear(put(np.zeros((f8.MAX_ROWS + 1, 128)), jnp.bfloat16), p)


# the interpreter simulates 2 SMs; the chained pipeline and the K split both run here
INTERP_CASES = [(1, 256, 256, 1), (5, 128, 512, 2), (16, 256, 512, 4), (24, 128, 384, 3)]


@pytest.mark.parametrize("m,n,k,num_splits", INTERP_CASES)
def test_kernel_interpret(m, n, k, num_splits):
    rng = np.random.default_rng(m + n + k)
    w = _random_fp8(rng, n, k)
    x = put(rng.standard_normal((m, k)), jnp.bfloat16)
    p = f8.prepare_fp8_linear(w, interpret=True, num_splits=num_splits)
    y = _fp8_linear(x, p)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    ref = _ref64(x, w)
    yf = np.asarray(y).astype(np.float32)
    assert np.isfinite(yf).all()
    assert _rel(y, ref) < 5e-3
    for r in range(m):  # row by row: a misplaced row fails even if the norm passes
        assert np.abs(yf[r] - ref[r]).max() <= 2e-2 * np.abs(ref[r]).max() + 1e-6
    _assert_matches_xla(x, w, y)


def _assert_matches_xla(x, w, y):
    """y equals XLA's dequantize + dot up to the order of the float32 sums: one bf16 step where that order
    crosses a rounding boundary (K-slice partials in bf16, the first version, were 0.3-0.6% of the max off)."""
    xla = np.asarray(_xla_product(x, w)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(y).astype(np.float32), xla, rtol=2.0**-7, atol=1e-4 * np.abs(xla).max())


@jax.jit
def _xla_product(x, w):
    """XLA's dequantize + dot, rounded to bf16 (the f32 view taken outside: a cast pair under jit may be folded)."""
    xla = jnp.einsum("mk,nk->mn", x, w.dequantize(jnp.bfloat16), preferred_element_type=jnp.float32)
    return xla.astype(jnp.bfloat16)


@pytest.mark.parametrize("g,n,k", [(1, 1280, 5120), (1, 32768, 1280), (8, 1024, 4096)])
def test_kernel_lowers_for_cuda(g, n, k):
    """The compiled kernel's Mosaic GPU pass (layouts, TMA boxes, swizzles, shared memory) at Flash's shapes, on
    the CPU: K split (float32 y^T partials) and not (bf16), grouped (wo_a, 8 groups), at the row counts whose
    tiles differ (8, 24, 128). The interpreter accepts layouts the GPU lowering rejects (a transposed float32
    store did not lower)."""
    sd = jax.ShapeDtypeStruct
    lead = (g,) if g > 1 else ()
    w = Fp8Weight(sd((*lead, n, k), jnp.float8_e4m3fn), sd((*lead, n // 32, k // 32), jnp.uint8))
    pw = jax.eval_shape(lambda w: f8.prepare_fp8_linear(w, check=False), w)
    assert (pw.splits > 1) == (n != 32768) and pw.groups == g
    for m in (1, 24, 128):
        jax.jit(f8.fp8_grouped_linear).trace(sd((g, m, k), jnp.bfloat16), pw).lower(lowering_platforms=("cuda",))


gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m,n,k", [(1, 1280, 5120), (8, 5120, 2304), (64, 2304, 5120), (128, 32768, 1280),
                                   (128, 1280, 5120)])
def test_kernel_gpu(m, n, k):
    rng = np.random.default_rng(m)
    w = _random_fp8(rng, n, k)
    x = put(rng.standard_normal((m, k)), jnp.bfloat16)
    y = jax.jit(f8.fp8_linear)(x, f8.prepare_fp8_linear(w))
    ref = np.asarray(f8.fp8_linear_reference(x, w), np.float64)
    assert np.isfinite(np.asarray(y.astype(jnp.float32))).all()
    assert _rel(y, ref) < 5e-3
    _assert_matches_xla(x, w, y)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 64, 128])
def test_grouped_kernel_gpu(m):
    """wo_a's shape: 8 groups of [1024, 4096], each group its own rows."""
    rng = np.random.default_rng(m)
    ws = [_random_fp8(rng, 1024, 4096) for _ in range(8)]
    w = Fp8Weight(jnp.stack([v.weight for v in ws]), jnp.stack([v.scale for v in ws]))
    x = put(rng.standard_normal((8, m, 4096)), jnp.bfloat16)
    y = jax.jit(f8.fp8_grouped_linear)(x, f8.prepare_fp8_linear(w))
    assert y.shape == (8, m, 1024) and np.isfinite(np.asarray(y.astype(jnp.float32))).all()
    for gi in range(8):
        _assert_matches_xla(x[gi], ws[gi], y[gi])


def test_prepare_linears_and_linear_dispatch():
    """backends.prepare_linears converts the FP8 linears the kernel takes and nothing else; the kernel Ops' linear
    runs them through the kernel at decode sizes (here in the interpreter) and through XLA above MAX_ROWS, both
    matching the Fp8Weight they came from."""
    from dsv41 import nn, quant
    from dsv41 import params as P
    from dsv41.config import preset

    cfg = preset("tiny")
    params = P.init_params(cfg, seed=0)
    prepared = BK.prepare_linears(params, cfg, interpret=True)
    is_p = lambda w: isinstance(w, f8.PreparedFp8)
    lp0, pp0 = params["layers"][0], prepared["layers"][0]
    converted = {jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(pp0, is_leaf=is_p) if is_p(v)}

    def get(tree, path):
        for key in path:
            tree = tree.get(key) if isinstance(tree, dict) else None
        return tree

    want = {"".join(f"['{key}']" for key in path) for path in BK.FP8_LINEARS if f8.supported(get(lp0, path))}
    assert converted == want and "['attn']['wq_a']" in converted
    assert not is_p(pp0["attn"]["wo_a"])  # grouped, 64 rows a group here: below the kernel's 128
    num = quant.Numerics(act_quant=False)
    rng = np.random.default_rng(3)
    # each pair of calls as one program (eagerly: dozens of small compiles)
    dense = jax.jit(lambda pw, w: (quant.dense(pw), quant.dense(w)))
    both = jax.jit(lambda x, pw, w: (BK.fp8_linear_op(x, pw, num, fp8_input=True),
                                     nn.linear(x, w, num, fp8_input=True)))
    for name in ("wq_a", "wo_b"):
        w, pw = lp0["attn"][name], pp0["attn"][name]
        dp, dw = dense(pw, w)
        assert np.asarray(dp).tobytes() == np.asarray(dw).tobytes()
        for rows in (3, f8.MAX_ROWS + 5):
            x = put(rng.standard_normal((rows, w.shape[1])), jnp.bfloat16)
            y, ref = both(x, pw, w)
            assert y.shape == ref.shape and y.dtype == ref.dtype
            assert _rel(y, np.asarray(ref).astype(np.float64)) < 1e-2


def test_grouped_wo_a_through_the_kernel():
    """wo_a: dense in our tree (as convert.py leaves it) but holding FP8 values; prepare_linears takes it back to
    FP8 exactly as G groups, and grouped_linear runs decode-sized inputs through the kernel (interpreter) as one
    grouped GEMM, matching the dense einsum; a weight whose values are not FP8 stays dense."""
    from dsv41 import nn, quant

    g, r, kg = 2, 128, 256
    rng = np.random.default_rng(4)

    @jax.jit  # one program: eagerly, the quantization and the sum are two dozen compiles
    def fp8_valued(a):
        w = quant.quantize_fp8_weight(a).dequantize(jnp.bfloat16)  # FP8 values, 32x32 blocks over [G * R, K]
        return w, w + jnp.asarray(1e-3, jnp.bfloat16)

    w, w_off = fp8_valued(put(rng.standard_normal((g * r, kg)) * 0.05, jnp.float32))
    pw = BK._grouped_fp8(w, g, interpret=True)
    assert isinstance(pw, f8.PreparedFp8) and pw.groups == g and pw.shape == (g, r, kg)
    dense = jax.jit(quant.dense, static_argnums=1)(pw, jnp.bfloat16)  # (eagerly: a compile an op)
    assert np.asarray(dense).reshape(g * r, kg).tobytes() == np.asarray(w).tobytes()
    assert BK._grouped_fp8(w_off, g, interpret=True) is None  # not FP8 values
    num = quant.Numerics(act_quant=False)
    both = jax.jit(lambda x, pw, w: (BK.fp8_grouped_linear_op(x, pw, num), nn.grouped_linear(x, w, num)))  # one program
    for rows in (3, f8.MAX_ROWS + 5):
        x = jnp.asarray(rng.standard_normal((rows, g, kg)), jnp.bfloat16)
        y, ref = both(x, pw, w)
        assert y.shape == ref.shape == (rows, g, r) and y.dtype == ref.dtype
        _assert_matches_xla_rows(y, ref)


def _assert_matches_xla_rows(y, ref):
    ref = np.asarray(ref).astype(np.float32)
    np.testing.assert_allclose(np.asarray(y).astype(np.float32), ref, rtol=2.0**-7, atol=1e-4 * np.abs(ref).max())
