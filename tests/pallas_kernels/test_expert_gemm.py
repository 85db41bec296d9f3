"""FP4 grouped expert GEMM: reference, XLA path, kernel layout, tile schedule, and the Mosaic GPU kernel in
the Mosaic GPU interpreter (CPU). GPU-only tests run the compiled kernel (marked `gpu`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41.quant import Fp4Weight, quantize_fp4_weight
from pallas_kernels import expert_gemm as eg
from serving.engine import backends as BK
from host_arrays import put

C = eg.KernelConfig

# Called eagerly, every jnp op of these on a new shape is an XLA compile of its own (dozens a call, most of this
# file's time on CPU); jitted, a call is one program of the same ops on the same inputs.
_matmul = jax.jit(eg.grouped_fp4_matmul, static_argnames=("backend", "config"))
_reference = jax.jit(eg.expert_gemm_reference)
_quantize = jax.jit(quantize_fp4_weight)
_dequantize = jax.jit(lambda w: w.dequantize(jnp.float32))
_scale_bytes = jax.jit(eg.kernel_scale_bytes, static_argnums=1)
_from_kernel = jax.jit(eg.ue8m0_from_kernel, static_argnums=1)


def _weights(rng, e, n, k, scale=0.05):
    return _quantize(put(rng.standard_normal((e, n, k)) * scale, np.float32))


def _random_weights_bytes(rng, e, n, k):
    """Every nibble code (incl. -0) and a spread of scale bytes."""
    packed = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
    scale = rng.integers(110, 129, (e, n, k // 32), dtype=np.uint8)
    return Fp4Weight(put(packed), put(scale))


def _np_reference(x, w: Fp4Weight, gs):
    """float64 per-row loop."""
    wd = np.asarray(_dequantize(w), np.float64)
    x = np.asarray(x, np.float64)  # bf16 / float32 -> float64 is exact
    y = np.zeros((x.shape[0], wd.shape[1]))
    r = 0
    for e, g in enumerate(np.asarray(gs)):
        y[r:r + g] = x[r:r + g] @ wd[e].T
        r += g
    return y


def _rel(a, b):
    a = np.asarray(np.asarray(a).astype(np.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_reference_matches_float64_loop():
    rng = np.random.default_rng(1)
    m, k, n, e = 23, 64, 48, 5
    x = put(rng.standard_normal((m, k)), jnp.bfloat16)
    w = _random_weights_bytes(rng, e, n, k)
    gs = put([4, 0, 9, 0, 7], np.int32)  # 20 of 23 rows: the last 3 must come out 0
    y = np.asarray(_reference(x, w, gs))
    ref = _np_reference(x, w, gs)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    assert (y[20:] == 0).all()


def test_xla_backend_close_to_reference():
    rng = np.random.default_rng(2)
    m, k, n, e = 30, 96, 64, 4
    x = put(rng.standard_normal((m, k)), jnp.bfloat16)
    w = _weights(rng, e, n, k)
    gs = put([10, 0, 12, 8], np.int32)
    y = _matmul(x, w, gs, backend="xla")
    assert y.dtype == jnp.bfloat16 and y.shape == (m, n)
    assert _rel(y, _np_reference(x, w, gs)) < 5e-3


def test_prepare_roundtrip_and_tile_decode_model():
    rng = np.random.default_rng(3)
    w = _random_weights_bytes(rng, 3, 64, 128)
    p = eg.prepare_fp4_experts(w)
    assert p.weight.shape == w.weight.shape and p.scale_t.shape == (3, 4, 64)
    u = jax.jit(eg.unprepare_fp4_experts)(p)
    assert (np.asarray(u.weight) == np.asarray(w.weight)).all()
    assert (np.asarray(u.scale) == np.asarray(w.scale)).all()
    # The interpreter's model of the register decode reproduces the dequantized tile exactly.
    a = jax.jit(lambda p: eg._dequant_tile_jnp(p.weight[2], p.scale_t[2]))(p)
    assert (np.asarray(a).astype(np.float32) == np.asarray(_dequantize(w))[2]).all()
    # The word/nibble permutation: nibble n of word c holds input 8*(n%4) + 2c + n//4.
    codes = put(np.arange(32, dtype=np.int32)[None])
    perm = np.asarray(jax.jit(eg._perm_to_kernel)(codes))[0]
    assert [perm[c * 8 + nn] for c in range(4) for nn in range(8)] == [
        8 * (nn % 4) + 2 * c + nn // 4 for c in range(4) for nn in range(8)]


def test_register_decoders_emulated_bit_exact():
    """The decoders' PTX text, run by a small emulator on every nibble / e4m3 byte and the whole range of
    kernel-layout scale bytes, gives exactly e2m1 (e4m3) x 2^(s-127) as bf16, -0 included."""
    import ml_dtypes
    import ptx_emulator

    from dsv41.quant import ue8m0_decode

    rng = np.random.default_rng(11)
    # FP4: out_j holds values j (low half) and j + 4 (high half) of the word; the PTX reads the kernel words,
    # i.e. the 8 values' bits as `prepare_fp4_experts` places them, here from 8 nibbles each
    words = np.concatenate([rng.integers(0, 2**32, 4000, dtype=np.uint64),
                            np.arange(16, dtype=np.uint64) * 0x11111111]).astype(np.uint32)
    kernel_words = np.asarray(jax.jit(eg._nibbles_to_kernel_bits)(put(words.view(np.uint8)))).view(np.uint32)
    assert (np.asarray(jax.jit(eg._kernel_bits_to_nibbles)(put(kernel_words.view(np.uint8)))).view(np.uint32)
            == words).all()
    s = np.concatenate([rng.integers(0, eg.MAX_SCALE_BYTE + 1, 4000), np.arange(16) * 8]).astype(np.uint8)
    e = np.asarray(_scale_bytes(put(s), eg.SCALE_BIAS)).astype(np.uint32)
    outs = ptx_emulator.run(eg._FP4_PTX, {4: kernel_words, 5: e}, 4)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    scale = np.asarray(jax.jit(ue8m0_decode)(put(s)))
    for j, o in enumerate(outs):
        got = ptx_emulator.bf16_values(o)
        for half, nib in enumerate((j, j + 4)):
            want = (e2m1[(words >> (4 * nib)) & 15] * scale).astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(got[:, half], want)
            np.testing.assert_array_equal(np.signbit(got[:, half]), np.signbit(want))
    # FP8: out_0 holds values 0 (low) and 1 (high), out_1 values 2 and 3, from the kernel words (the 4 e4m3
    # bytes' bits as `fp8_linear.prepare_fp8_linear` places them); e4m3 NaN bytes excluded
    codes = np.concatenate([np.arange(256), rng.integers(0, 256, 4 * 4000 - 256)]).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    words8 = np.asarray(jax.jit(eg.fp8_bytes_to_kernel_bits)(put(codes))).view(np.uint32)
    assert (np.asarray(jax.jit(eg.fp8_kernel_bits_to_bytes)(put(words8.view(np.uint8)))) == codes).all()
    s8 = rng.integers(0, 135, words8.shape[0]).astype(np.uint8)
    e8 = np.asarray(_scale_bytes(put(s8), eg.FP8_SCALE_BIAS)).astype(np.uint32)
    outs8 = ptx_emulator.run(eg._FP8_PTX, {2: words8, 3: e8}, 2)
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(-1, 4)
    scale8 = np.asarray(jax.jit(ue8m0_decode)(put(s8)))
    for j, o in enumerate(outs8):
        got = ptx_emulator.bf16_values(o)
        want = (vals[:, 2 * j:2 * j + 2] * scale8[:, None]).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_kernel_scale_bytes_are_the_multiplier_exponent():
    s = put(np.arange(0, eg.MAX_SCALE_BYTE + 1, dtype=np.uint8))
    e = _scale_bytes(s, eg.SCALE_BIAS)
    assert (np.asarray(e) == np.arange(0, 129) + 126).all()
    assert (np.asarray(_from_kernel(e, eg.SCALE_BIAS)) == np.asarray(s)).all()


def test_prepare_rejects_large_scales():
    w = Fp4Weight(put(np.zeros((1, 8, 16), np.uint8)), put(np.full((1, 8, 1), 129, np.uint8)))
    with pytest.raises(ValueError):
        eg.prepare_fp4_experts(w)  # eager: the check reads the largest scale byte, which a trace does not have


@pytest.mark.parametrize("gs,tm", [([5, 0, 11, 0, 3], 8), ([0, 0, 17, 0, 0], 8), ([1, 1, 1, 1, 1], 16),
                                   ([0, 0, 0, 0, 0], 8), ([40, 0, 2, 0, 0], 16), ([9, 7, 8, 16, 1], 8)])
def test_tile_schedule(gs, tm):
    m = max(sum(gs), 1) + 2
    e = len(gs)
    t_max = eg.max_tiles(m, e, tm)
    sched = jax.jit(eg.tile_schedule, static_argnums=(1, 2, 3))(put(gs, np.int32), m, tm, t_max)
    te, tr, src, pos, valid = (np.asarray(a) for a in sched)
    starts = np.cumsum(gs) - gs
    pstarts = np.cumsum([-(-g // 8) * 8 for g in gs]) - [-(-g // 8) * 8 for g in gs]
    live = te >= 0
    assert live.sum() <= t_max and (te[~live] == -1).all() and live[:live.sum()].all()
    # an expert's weights are read once per tm of its rows: the fewest tiles of tm rows
    assert live.sum() == sum(-(-g // tm) for g in gs)
    # the padded row layout: each expert's rows in order from a multiple of 8, padding rows point past m
    assert src.shape == (eg.padded_rows(m, e),)
    for ex, g in enumerate(gs):
        assert pstarts[ex] % 8 == 0 and (src[pstarts[ex]:pstarts[ex] + g] == starts[ex] + np.arange(g)).all()
    assert ((src == m) | np.isin(src, np.arange(sum(gs)))).all() and (src < m).sum() == sum(gs)
    # every live tile starts on a multiple of 8, tm apart from its expert's first padded row
    for t in np.nonzero(live)[0]:
        ex, r0 = te[t], tr[t]
        assert gs[ex] > 0 and r0 % 8 == 0 and (r0 - pstarts[ex]) % tm == 0
        assert pstarts[ex] <= r0 < pstarts[ex] + gs[ex]
    # every row of a group lands in its own slot, in a tile of its expert whose padded rows hold it there
    rows = np.nonzero(valid)[0]
    assert len(rows) == sum(gs) and len(set(pos[rows])) == len(rows)
    for r in rows:
        t, off = divmod(pos[r], tm)
        ex = np.searchsorted(np.cumsum(gs), r, side="right")
        assert te[t] == ex and src[tr[t] + off] == r


# Mosaic GPU interpreter runs (the interpreter's buffers start as NaN, so an unwritten output slot that is
# gathered shows up as NaN; rows outside every group must come out exactly 0).
INTERP_CASES = [
    # m, k, n, group sizes, config
    (20, 128, 128, [7, 0, 11], C(tm=8, tk=64, num_wgs=2, stages=2)),  # 2 rows past the groups
    (24, 192, 128, [0, 9, 0, 15, 0], C(tm=8, tk=64, num_wgs=1, stages=3)),  # 3 k-steps, 2 n-blocks
    (16, 64, 64, [0, 16, 0, 0], C(tm=16, tk=64, num_wgs=1, stages=2)),  # one expert, one full tile
    # chained items (2 SMs in the interpreter): 2 k-steps per item, 4-6 items per SM, one SM with a lone item
    (40, 128, 128, [5, 0, 17, 3, 15], C(tm=8, tk=64, num_wgs=1, stages=2, chain=True)),
    (20, 128, 128, [7, 0, 11], C(tm=8, tk=64, num_wgs=2, stages=2, chain=True)),
    (8, 128, 64, [8], C(tm=8, tk=64, num_wgs=1, stages=2, chain=True)),  # one item: the plain pipeline
    # K slices (float32 partials summed outside): 2 and 3 slices, chained and not, an empty group between
    (20, 256, 128, [7, 0, 11], C(tm=8, tk=64, num_wgs=2, stages=2, chain=True, ksplit=2)),
    (24, 192, 128, [0, 9, 0, 15, 0], C(tm=8, tk=64, num_wgs=1, stages=1, ksplit=3)),
    # each step's tile decoded and multiplied in two halves of K (KernelConfig.overlap), chained and not
    (40, 256, 128, [5, 0, 17, 3, 15], C(tm=8, tk=128, num_wgs=2, stages=2, chain=True, overlap=True)),
    (24, 512, 128, [0, 9, 0, 15, 0], C(tm=16, tk=256, num_wgs=1, stages=2, overlap=True)),
    # warp-level mma.sync (the sums values carried from step to step; the interpreter multiplies with a dot):
    # chained, and 16-row tiles over 2 warpgroups unchained
    (40, 128, 128, [5, 0, 17, 3, 15], C(tm=8, tk=64, num_wgs=1, stages=2, chain=True, warp_mma=1)),
    (24, 192, 128, [0, 9, 0, 15, 0], C(tm=16, tk=64, num_wgs=2, stages=3, warp_mma=4)),
]


@pytest.mark.parametrize("m,k,n,gs,cfg", INTERP_CASES)
def test_kernel_interpret(m, k, n, gs, cfg):
    rng = np.random.default_rng(m * 1000 + k + n)
    e = len(gs)
    x = put(rng.standard_normal((m, k)), jnp.bfloat16)
    w = _random_weights_bytes(rng, e, n, k)
    gsj = put(gs, np.int32)
    # one program (the schedule and row gathers around the kernel would be dozens of small eager compiles)
    run = jax.jit(functools.partial(eg.grouped_fp4_matmul, backend="interpret", config=cfg))
    y = np.asarray(run(x, eg.prepare_fp4_experts(w), gsj)).astype(np.float32)
    ref = _np_reference(x, w, gsj)
    assert np.isfinite(y).all()
    assert (y[sum(gs):] == 0).all()
    assert _rel(y, ref) < 5e-3
    for r in range(sum(gs)):  # row by row: a misplaced row fails even if the norm passes
        assert np.abs(y[r] - ref[r]).max() <= 2e-2 * np.abs(ref[r]).max() + 1e-6, r


def test_kernel_interpret_all_groups_empty():
    x = put(np.ones((8, 64), jnp.bfloat16))
    w = _random_weights_bytes(np.random.default_rng(5), 2, 64, 64)
    y = _matmul(x, w, put(np.zeros((2,), np.int32)), backend="interpret", config=C(tm=8, tk=64, num_wgs=1, stages=2))
    assert (np.asarray(y).astype(np.float32) == 0).all()


def test_config_validation():
    # jitted, the checks raise while tracing (before any compile); eagerly the schedule ran op by op first
    x = np.zeros((8, 96), jnp.bfloat16)
    gs = np.array([8], np.int32)
    w = _random_weights_bytes(np.random.default_rng(6), 1, 64, 96)
    with pytest.raises(ValueError):
        _matmul(x, w, gs, backend="interpret", config=C(tm=8, tk=64, num_wgs=1))  # K=96 is not a multiple of tk
    w = _random_weights_bytes(np.random.default_rng(6), 1, 64, 192)
    x = np.zeros((8, 192), jnp.bfloat16)
    with pytest.raises(ValueError, match="ksplit"):
        _matmul(x, w, gs, backend="interpret", config=C(tm=8, tk=64, num_wgs=1, ksplit=2))  # 3 k-steps in 2 slices
    with pytest.raises(ValueError, match="num_wgs=4"):  # hung the H200: refused
        _matmul(x, w, gs, backend="interpret", config=C(tm=8, tk=64, num_wgs=4))
    w384 = _random_weights_bytes(np.random.default_rng(6), 1, 64, 384)
    with pytest.raises(ValueError, match="multiple of 128"):  # 192 bytes a row: no 128-byte swizzle (the H200's
        _matmul(np.zeros((8, 384), jnp.bfloat16), w384, gs,  # assertion)
                backend="interpret", config=C(tm=8, tk=384, num_wgs=1))
    with pytest.raises(ValueError, match="warp_mma"):  # the halves are about wgmma's asynchrony
        _matmul(x, w, gs, backend="interpret", config=C(tm=8, tk=128, num_wgs=1, overlap=True, warp_mma=4))
    with pytest.raises(ValueError, match="8 or 16 rows"):  # x's B fragments would not fit the registers
        _matmul(x, w, gs, backend="interpret", config=C(tm=64, tk=64, num_wgs=1, warp_mma=4))


@pytest.mark.parametrize("n,k,cfg", [(4608, 5120, C(tm=8, tk=128, num_wgs=2, stages=4, chain=True, ksplit=5)),
                                     (5120, 2304, C(tm=8, tk=128, num_wgs=2, stages=3, chain=True, ksplit=3))])
def test_ksplit_lowers_for_cuda(n, k, cfg):
    """K slices at Flash's expert shapes (fused w1/w3, w2), one decode token's 6 rows, through the Mosaic GPU
    lowering for sm_90a: the float32 y^T partial tiles and the sliced TMA sources (the interpreter accepts
    layouts the GPU rejects)."""
    sd, e = jax.ShapeDtypeStruct, 16
    w = eg.PreparedFp4(sd((e, n, k // 2), jnp.uint8), sd((e, k // 32, n), jnp.uint8))
    jax.jit(lambda x, w, g: eg.grouped_fp4_matmul_pallas(x, w, g, cfg)).trace(
        sd((6, k), jnp.bfloat16), w, sd((e,), jnp.int32)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("m,cfg", [(6, C(tm=8, tk=256, num_wgs=2, stages=4, chain=True, overlap=True)),
                                   (48, C(tm=8, tk=512, num_wgs=2, stages=5, chain=True, overlap=True)),
                                   (12288, C(tm=64, tk=256, num_wgs=2, stages=4, chain=True, overlap=True)),
                                   (12288, C(tm=128, tk=128, num_wgs=2, stages=4, overlap=True)),
                                   (6, C(tm=8, tk=256, num_wgs=2, stages=4, chain=True, warp_mma=4)),
                                   (48, C(tm=8, tk=512, num_wgs=2, stages=5, chain=True, warp_mma=4))])
def test_overlap_lowers_for_cuda(m, cfg):
    """Each step's tile decoded and multiplied in two halves of K (register A halves, two wgmmas, one wait) at
    Flash's fused w1/w3 shape, through the Mosaic GPU lowering for sm_90a (decode, a 2048-token chunk over 384
    experts, the 128-row prefill tiles); and with warp-level mma.sync instead (`warp_mma`: the decoded registers
    regrouped as its A operand, x's B fragments loaded from the swizzled stage)."""
    sd, e, n, k = jax.ShapeDtypeStruct, 384, 4608, 5120
    w = eg.PreparedFp4(sd((e, n, k // 2), jnp.uint8), sd((e, k // 32, n), jnp.uint8))
    jax.jit(lambda x, w, g: eg.grouped_fp4_matmul_pallas(x, w, g, cfg)).trace(
        sd((m, k), jnp.bfloat16), w, sd((e,), jnp.int32)).lower(lowering_platforms=("cuda",))


def test_default_configs_at_flash_shapes():
    """Decode and prefill chunks with few rows an expert chain every SM's items (the stages divide the K steps)
    for w1/w3 (K 5120) and w2 (K 2304): unchained, w2 took 665 us at 64 tokens on the H200 against 612 chained.
    w1/w3 and w2 of one MoE take the same tile rows (dsv41.moe runs both on one tile schedule). The 8-row decode
    tiles multiply with mma.sync into 4 accumulators, the 64-row tiles with wgmma in two halves of K (faster
    there on the H200), the 128-row ones with wgmma whole (slower in halves there)."""
    for m, tm in ((6, 8), (384, 8), (2048 * 6, 64), (8192 * 6, 128)):
        cfgs = [eg.default_config(m, n, k, 384) for n, k in [(4608, 5120), (5120, 2304)]]
        assert {c.tm for c in cfgs} == {tm}, (m, cfgs)
        for (n, k), cfg in zip([(4608, 5120), (5120, 2304)], cfgs):
            if tm < 128:
                assert cfg.chain and (k // cfg.tk) % cfg.stages == 0 and cfg.stages >= 3, (k, cfg)
            assert (cfg.warp_mma, cfg.overlap) == ((4, False) if tm == 8 else (0, tm == 64)), cfg
    # decode's longest steps (faster at 64 tokens on the H200): w2 in 3 of 768 at any batch, w1/w3 in 10 of 512
    # past one token's 6 rows (at one token 256 inputs a step were faster)
    assert [(c.tk, c.stages) for c in (eg.default_config(m, n, k, 384) for m in (6, 48, 384)
                                       for n, k in [(4608, 5120), (5120, 2304)])] == \
        [(256, 4), (768, 3), (512, 5), (768, 3), (512, 5), (768, 3)]


gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m,cfg,k", [(48, C(tm=8, tk=256, num_wgs=2, stages=4), 512),
                                   (1536, C(tm=128, tk=128, num_wgs=2, stages=4), 512),
                                   (384, C(tm=8, tk=256, num_wgs=2, stages=2, chain=True), 512),
                                   (1536, C(tm=128, tk=128, num_wgs=2, stages=4, chain=True), 512),
                                   (1536, C(tm=64, tk=256, num_wgs=2, stages=2, chain=True), 512),
                                   (384, C(tm=8, tk=256, num_wgs=2, stages=2, chain=True, overlap=True), 512),
                                   (1536, C(tm=128, tk=128, num_wgs=2, stages=4, overlap=True), 512),
                                   (6, C(tm=8, tk=128, num_wgs=2, stages=2, chain=True, ksplit=2), 512),
                                   (48, C(tm=8, tk=512, num_wgs=2, stages=5, chain=True, overlap=True), 2560),
                                   (48, C(tm=8, tk=768, num_wgs=2, stages=3, chain=True, overlap=True), 2304),
                                   # warp-level mma.sync: one token's w1/w3 config, 8 and 16-row tiles, the longer
                                   # steps of 8 tokens and of w2
                                   pytest.param(6, C(tm=8, tk=256, num_wgs=2, stages=4, chain=True, warp_mma=4),
                                                5120, id="mma-1token"),
                                   pytest.param(384, C(tm=8, tk=256, num_wgs=2, stages=2, chain=True, warp_mma=4),
                                                512, id="mma-tm8"),
                                   pytest.param(384, C(tm=16, tk=256, num_wgs=2, stages=2, chain=True,
                                                       warp_mma=2), 512, id="mma-tm16"),
                                   pytest.param(48, C(tm=8, tk=512, num_wgs=2, stages=5, chain=True, warp_mma=4),
                                                2560, id="mma-tk512"),
                                   pytest.param(48, C(tm=8, tk=768, num_wgs=2, stages=3, chain=True, warp_mma=4),
                                                2304, id="mma-tk768")])
def test_kernel_gpu(m, cfg, k):
    rng = np.random.default_rng(7)
    e, n = 16, 256
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = _random_weights_bytes(rng, e, n, k)
    gs = np.bincount(rng.integers(0, e, m - 3), minlength=e)
    gs[3] = 0
    gs[0] += gs[3]
    gsj = jnp.asarray(gs, jnp.int32)
    y = eg.grouped_fp4_matmul(x, eg.prepare_fp4_experts(w), gsj, backend="pallas", config=cfg)
    ref = np.asarray(eg.expert_gemm_reference(x, w, gsj))
    y = np.asarray(y.astype(jnp.float32))
    assert np.isfinite(y).all() and (y[gs.sum():] == 0).all()
    assert _rel(y, ref) < 5e-3


@pytest.mark.parametrize("act_quant", [False, True])
def test_moe_layer_through_the_kernel_equals_xla(act_quant):
    """dsv41.moe with the experts in the kernel layout (backends.prepare_experts and the kernel Ops; here the
    kernel in the interpreter) against the XLA path on the same FP4 weights: routing, sort, SwiGLU, weighting and
    the sum over each token's experts around the GEMMs (the kernel path keeps its rows in the kernel's layouts between them), with and
    without the served FP8 quantization of the activations."""
    from dsv41 import moe
    from dsv41 import params as P
    from dsv41.config import preset
    from dsv41.quant import Numerics

    cfg = preset("tiny")
    params = P.init_params(cfg, seed=1)
    lp = params["layers"][0]["ffn"]
    prepared = BK.prepare_experts({"layers": [params["layers"][0]]}, interpret=True)["layers"][0]["ffn"]
    assert isinstance(prepared["experts"]["w2"], eg.PreparedFp4)
    assert set(prepared["experts"]) == {"w13", "w2"}  # w1 and w3 in one call
    again = BK.prepare_experts({"layers": [{"ffn": prepared}]}, interpret=True)["layers"][0]["ffn"]["experts"]
    assert again["w13"] is prepared["experts"]["w13"]  # preparing twice is a no-op
    num = Numerics(act_quant=act_quant, bf16_probs=True, dtype="bfloat16")
    x = put(np.random.default_rng(8).standard_normal((2, 7, cfg.dim)), jnp.bfloat16)
    # one program each: eager ops dispatched while the interpreter's callback thread runs can deadlock it
    y_xla = jax.block_until_ready(jax.jit(lambda x, p: moe.moe(x, p, cfg, num))(x, lp))
    y_kernel = jax.jit(lambda x, p: moe.moe(x, p, cfg, num, ops=BK.kernel_ops(experts=True)))(x, prepared)
    assert _rel(y_kernel, np.asarray(np.asarray(y_xla).astype(np.float32), np.float64)) < 1e-2


def test_kernel_experts_on_one_rank_of_expert_parallel():
    """The kernel path on one expert-parallel rank's experts (`sharding.ExpertParallel`'s permutation: the other
    ranks' slots sorted past its groups) equals the XLA path on the same permutation: those slots add nothing
    (they once read the kernel output's last row, unwritten: NaN in the interpreter)."""
    from dsv41 import moe
    from dsv41 import params as P
    from dsv41.config import preset
    from dsv41.quant import Numerics

    cfg = preset("tiny")
    ex = P.init_params(cfg, seed=1)["layers"][0]["ffn"]["experts"]
    mine_n = 2  # this rank: experts [0, 2) of 8
    ex = jax.jit(lambda ex: {k: jax.tree_util.tree_map(lambda a: a[:mine_n], w) for k, w in ex.items()})(ex)
    prepared = BK.prepare_experts({"layers": [{"ffn": {"experts": ex}}]}, interpret=True)["layers"][0]["ffn"]
    rng = np.random.default_rng(9)
    x = put(rng.standard_normal((6, cfg.dim)), jnp.bfloat16)
    idx = put(np.stack([rng.choice(cfg.n_routed_experts, 2, replace=False) for _ in range(6)]), np.int32)

    @jax.jit
    def slots(idx, w):
        mine = idx < mine_n
        lid = jnp.where(mine, idx, mine_n).reshape(-1)
        perm = (jnp.argsort(lid, stable=True), jnp.bincount(lid, length=mine_n).astype(jnp.int32))
        return mine, perm, jnp.where(mine, w, 0.0)

    mine, perm, w = slots(idx, put(rng.random((6, 2)), np.float32))
    num = Numerics(act_quant=True, bf16_probs=True, dtype="bfloat16")
    run = jax.jit(lambda x, w, p: (moe.routed_experts(x, w, idx, ex, cfg, num, perm),
                                   BK.routed_experts_op(x, w, idx, p, cfg, num, perm)))
    want, got = run(x, w, prepared["experts"])
    assert 0 < int(np.asarray(mine).sum()) < mine.size
    assert np.isfinite(np.asarray(got)).all()
    assert _rel(got, np.asarray(want, np.float64)) < 1e-2


def test_prepare_experts_rejects_dense_weights():
    dense = {"layers": [{"ffn": {"experts": {"w1": put(np.zeros((2, 128, 256), jnp.bfloat16))}}}]}
    with pytest.raises(ValueError, match="not FP4"):
        BK.prepare_experts(dense)
