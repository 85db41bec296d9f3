"""The in-kernel twins (pallas_kernels/codec_ptx) equal dsv41.quant bit for bit, on every byte value / code.

The PTX text the GPU runs is executed by tests/pallas_kernels/ptx_emulator.py on the CPU (the Mosaic GPU
interpreter cannot run `inline_mgpu`). On the GPU the producers' dequant probes run it on every scale byte (the
gpu-marked cases at the end; on the CPU the same tests run the interpreter's jnp path)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ptx_emulator
from dsv41 import quant
from pallas_kernels import codec_ptx
from pallas_kernels import indexer_logits as il
from pallas_kernels import sparse_attention as sa

# the kernel's PTX on the GPU; the interpreter's jnp producer everywhere
PRODUCERS = [pytest.param(False, marks=pytest.mark.gpu, id="gpu"), pytest.param(True, id="interpret")]

BYTES = np.arange(256, dtype=np.uint32)

# dsv41.quant's decoders as programs (bit-identical; their inputs numpy bytes): eagerly each is a compile an op and
# input shape
_ue8m0_decode = jax.jit(quant.ue8m0_decode)
_e4m3_decode = jax.jit(quant.e4m3_decode)
_e2m1_decode_packed = jax.jit(quant.e2m1_decode_packed)


def _bf16_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _halves(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (r & 0xFFFF).astype(np.uint16), (r >> 16).astype(np.uint16)


def _same(got_bits: np.ndarray, want_bits: np.ndarray):
    """Bit equality, except that any NaN equals any NaN (payloads are not part of the format)."""
    got = got_bits.view(ml_dtypes.bfloat16).astype(np.float32)
    want = want_bits.view(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got_bits[~nan], want_bits[~nan])


def test_ue8m0_f32_twin_all_bytes():
    (bits,) = ptx_emulator.run(codec_ptx.UE8M0_F32_PTX, {1: BYTES}, 1)
    want = np.asarray(_ue8m0_decode(BYTES.astype(np.uint8)))
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(bits.view(np.float32)), nan)
    np.testing.assert_array_equal(bits[~nan], want.view(np.uint32)[~nan])


def test_ue8m0_bf16x2_twin_all_bytes():
    (r,) = ptx_emulator.run(codec_ptx.UE8M0_BF16X2_PTX, {1: BYTES}, 1)
    want = _bf16_bits(_ue8m0_decode(BYTES.astype(np.uint8)))
    for half in _halves(r):
        _same(half, want)


def test_e4m3_scale_twin_all_bytes():
    """Both bytes of the scale pair over all 256 values (the other byte a different value each time)."""
    lo, hi = BYTES, (BYTES * 37 + 11) % 256
    s_lo, s_hi = ptx_emulator.run(codec_ptx.E4M3_SCALE_PTX, {2: lo | (hi << 8) | (0xABCD << 16)}, 2)
    for r, b in ((s_lo, lo), (s_hi, hi)):
        want = _bf16_bits(_e4m3_decode(b.astype(np.uint8)))
        for half in _halves(r):
            _same(half, want)


def test_e4m3_word_twin_all_bytes():
    """Every e4m3 byte in every position of the word, times power-of-two scales over a wide range, byte 0's
    and 255's included."""
    rng = np.random.default_rng(0)
    words = np.concatenate([BYTES * 0x01010101, rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32)])
    sb = rng.integers(90, 160, words.shape).astype(np.uint8)
    sb[256:512], sb[512:768] = 0, 255                                     # 2^-127 (subnormal products) and NaN
    scales = np.asarray(_ue8m0_decode(sb))
    out = ptx_emulator.run(codec_ptx.E4M3_WORD_PTX, {2: words, 3: scales.view(np.uint32)}, 2)
    vals = np.asarray(_e4m3_decode(words.view(np.uint8).reshape(-1, 4)))
    want = _bf16_bits(vals * scales[:, None])                            # [n, 4]
    for j, r in enumerate(out):
        for h, half in enumerate(_halves(r)):
            _same(half, want[:, 2 * j + h])


def test_fp4_word_twin_all_codes():
    """Every byte (two codes) in every position, times the scales the kernels hand it: UE8M0 (MXFP4 index keys,
    as `UE8M0_BF16X2_PTX` builds them) and E4M3 (main KV, as `E4M3_SCALE_PTX` builds them)."""
    rng = np.random.default_rng(1)
    words = np.concatenate([BYTES * 0x01010101, rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32)])
    ue = rng.integers(100, 150, words.shape).astype(np.uint32)
    ue[:256] = 0                                                         # byte 0: the subnormal scale 2^-127
    ue[256:512] = 1
    (ue2,) = ptx_emulator.run(codec_ptx.UE8M0_BF16X2_PTX, {1: ue}, 1)
    e4 = rng.integers(0, 0x7F, words.shape).astype(np.uint32)           # positive, finite e4m3 scales
    e42, _ = ptx_emulator.run(codec_ptx.E4M3_SCALE_PTX, {2: e4}, 2)
    vals = np.asarray(_e2m1_decode_packed(words.view(np.uint8).reshape(-1, 4)))                     # [n, 8]
    for s2, s in ((ue2, _ue8m0_decode(ue.astype(np.uint8))), (e42, _e4m3_decode(e4.astype(np.uint8)))):
        out = ptx_emulator.run(codec_ptx.FP4_WORD_PTX, {4: words, 5: s2}, 4)
        want = _bf16_bits(vals * np.asarray(s)[:, None])
        for j, r in enumerate(out):
            for h, half in enumerate(_halves(r)):
                np.testing.assert_array_equal(half, want[:, 2 * j + h])       # -0 included: bits


# ---- the kernels' producers on every scale byte (the PTX on the GPU; the interpreter's jnp path on the CPU) ----


def _all_byte_pool(n_rows, data_cols, scale_cols, e4m3_data):
    """Pool rows whose scale bytes run through all 256 values (0 and 255 included) and random data bytes
    (e4m3 NaN bytes left out: NaN x scale says nothing about the scale)."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (n_rows, data_cols)).astype(np.uint8)
    if e4m3_data:
        data[(data & 0x7F) == 0x7F] = 0x7E
    scale = (np.arange(n_rows * scale_cols) % 256).astype(np.uint8).reshape(n_rows, scale_cols)
    return jax.device_put(data), jax.device_put(scale)  # (jnp.asarray: a device program a shape under JAX 0.11)


def _bits_equal(got, want):
    got, want = np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
    nan = np.isnan(np.asarray(want.view(ml_dtypes.bfloat16), np.float32))
    np.testing.assert_array_equal(np.isnan(got.view(ml_dtypes.bfloat16).astype(np.float32)), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("interpret", PRODUCERS)
def test_swa_producer_every_scale_byte(interpret):
    """sparse_attention's FP8 producer (E4M3_WORD_PTX x UE8M0_F32_PTX) on scale bytes 0..255: quant.fp8_decode."""
    src, sc = _all_byte_pool(sa.TILE, 512, 16, e4m3_data=True)                 # 64 x 16 = 1024 scale bytes
    rows = np.arange(sa.TILE, dtype=np.int32)
    # the probe and the decode each one program (bit-identical): eagerly their gathers and decodes are some 30 compiles
    out, _ = jax.jit(lambda *a: sa.dequant_probe("fp8", *a, interpret=interpret))(src, sc, rows)
    _bits_equal(out, jax.jit(lambda src, sc: quant.fp8_decode(src, sc).astype(jnp.bfloat16))(src, sc))


@pytest.mark.parametrize("interpret", PRODUCERS)
def test_index_key_producer_every_scale_byte(interpret):
    """indexer_logits' MXFP4 producer (FP4_WORD_PTX x UE8M0_BF16X2_PTX) on scale bytes 0..255: quant.mxfp4_decode."""
    pk, sc = _all_byte_pool(64, 64, 4, e4m3_data=False)                        # 64 entries of ID = 128
    rows = np.arange(64, dtype=np.int32)
    # the probe and the decode each one program (bit-identical): eagerly their gathers and decodes are some 45 compiles
    k, _ = jax.jit(lambda pk, sc, rows: il.dequant_probe(pk.reshape(1, 64, 64), sc.reshape(1, 64, 4), rows,
                                                         interpret=interpret))(pk, sc, rows)
    _bits_equal(k, jax.jit(lambda pk, sc: quant.mxfp4_decode(pk, sc).astype(jnp.bfloat16))(pk, sc))
