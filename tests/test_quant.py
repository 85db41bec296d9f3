import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41 import quant


def test_e2m1_rounds_to_nearest_even():
    x = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.74, -2.6, 0.0])
    v = quant.e2m1_values(quant.e2m1_codes(jnp.clip(x, -6, 6)))
    np.testing.assert_array_equal(np.asarray(v), [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -3.0, 0.0])


def test_e2m1_matches_ml_dtypes():
    x = np.random.default_rng(0).uniform(-6, 6, 4096).astype(np.float32)
    ours = np.asarray(quant.e2m1_values(quant.e2m1_codes(jnp.asarray(x))))
    theirs = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(ours, theirs)


def test_pow2_scale_is_ceil_of_log2():
    amax = jnp.array([448.0, 449.0, 1.0, 896.0, 1e-4])
    s = np.asarray(quant.pow2_scale(amax, 448.0))
    np.testing.assert_array_equal(s, [1.0, 2.0, 2.0**-8, 2.0, 2.0**-22])


def test_e4m3_round_is_the_cast_without_one():
    """quant.e4m3_round against ml_dtypes' float8_e4m3fn cast: every e4m3 value, every midpoint between two
    neighbours (ties to even), a hair either side of each, subnormals, saturation, random values; under jit too."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = (grid[:-1] + grid[1:]) / 2
    x = np.concatenate([grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), [500.0, -1e6, 1e-12],
                        np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 50]).astype(np.float32)
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(quant.e4m3_round(jnp.asarray(x))), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.e4m3_round)(jnp.asarray(x))), want)


def test_fp8_qdq_matches_a_numpy_port():
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32) * 10
    g = x.reshape(4, 2, 32)
    amax = np.maximum(np.abs(g).max(-1), 1e-4)
    s = 2.0 ** np.ceil(np.log2(amax / 448.0))
    ref = (np.clip(g / s[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s[..., None])
    np.testing.assert_array_equal(np.asarray(quant.fp8_qdq(jnp.asarray(x))), ref.reshape(4, 64))
    # under jit too (one program: a float8 cast pair there is what XLA's GPU compiler folds)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.fp8_qdq)(jnp.asarray(x))), ref.reshape(4, 64))


def test_compressed_kv_codes_match_the_stored_scale():
    """As the pool is written (kv_write.token_bytes, one program): the codes and the E4M3 scale byte stored beside
    them. Read back with the stored scale they must give the quantize-dequantize values: codes cut against an
    unrounded scale (a folded cast pair) read back up to 1/16 off."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 512)) * 3, jnp.float32)

    @jax.jit
    def write(x):
        packed, s = quant.fp4_quantize(x, 16, e4m3_scales=True)
        return packed, quant.e4m3(s)

    packed, stored = write(x)
    back = quant.fp4_dequantize(packed, np.asarray(stored).astype(np.float32), 16)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(quant.fp4_qdq(x, 16, True)))


@pytest.mark.parametrize("block, e4m3", [(16, True), (32, False)])
def test_fp4_pack_round_trip_equals_qdq(block, e4m3):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32))
    packed, s = quant.fp4_quantize(x, block, e4m3)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 64)
    np.testing.assert_array_equal(np.asarray(quant.fp4_dequantize(packed, s, block)),
                                  np.asarray(quant.fp4_qdq(x, block, e4m3)))
    # the serving pool re-quantizes values that were already round-tripped: that must be lossless
    again = quant.fp4_qdq(quant.fp4_qdq(x, block, e4m3), block, e4m3)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(quant.fp4_qdq(x, block, e4m3)))
    np.testing.assert_array_equal(np.asarray(quant.fp8_qdq(quant.fp8_qdq(x))), np.asarray(quant.fp8_qdq(x)))


def test_nibble_order_low_first():
    codes = jnp.array([[1, 2, 3, 15]], jnp.uint8)
    np.testing.assert_array_equal(np.asarray(quant.pack_nibbles(codes)), [[0x21, 0xF3]])
    np.testing.assert_array_equal(np.asarray(quant.unpack_nibbles(quant.pack_nibbles(codes))), codes)


def test_weight_formats_round_trip():
    w = np.random.default_rng(3).standard_normal((70, 96)).astype(np.float32)  # 70: a partial 32-row block
    q8 = quant.quantize_fp8_weight(w)
    assert q8.weight.dtype == jnp.float8_e4m3fn and q8.scale.shape == (3, 3)
    d8 = np.asarray(q8.dequantize())
    assert np.abs(d8 - w).max() / np.abs(w).max() < 0.07
    np.testing.assert_array_equal(np.asarray(quant.quantize_fp8_weight(d8).dequantize()), d8)
    q4 = quant.quantize_fp4_weight(w)
    assert q4.weight.shape == (70, 48) and q4.scale.shape == (70, 3) and q4.shape == (70, 96)
    d4 = np.asarray(q4.dequantize())
    np.testing.assert_array_equal(np.asarray(quant.quantize_fp4_weight(d4).dequantize()), d4)
    # exactly representable in bf16: the XLA path dequantizes into bf16 without loss
    np.testing.assert_array_equal(np.asarray(q4.dequantize(jnp.bfloat16), np.float32), d4)
    np.testing.assert_array_equal(np.asarray(quant.ue8m0_decode(quant.ue8m0_encode(jnp.array([2.0**-5])))), [2.0**-5])


@jax.jit  # one program: eagerly every op is a compile
def _encode(x):
    return (quant.fp8_encode(x), quant.kv_fp4_encode(x), quant.mxfp4_encode(x)), (
        quant.fp8_qdq(x), quant.kv_fp4_qdq(x), quant.mxfp4_qdq(x))


@jax.jit  # a program of its own: the bytes arrive as the pool's do, not from an encode XLA may fold away
def _decode(records):
    (q8, s8), (p4, s4), (pm, sm) = records
    f8 = lambda b: jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)  # noqa: E731
    return ((quant.fp8_decode(q8, s8), quant.fp8_decode(f8(q8), s8)),
            (quant.kv_fp4_decode(p4, s4), quant.kv_fp4_decode(p4, f8(s4))),
            (quant.mxfp4_decode(pm, sm), quant.mxfp4_decode(pm, sm)))  # UE8M0 has no float8 spelling here


def test_pool_records_decode_to_the_qdq_values():
    """Each KV record's bytes (spec §4 table) decode to exactly the quantize-dequantize values the model uses,
    from uint8 bytes or from the float8 dtype alike."""
    x = jax.random.normal(jax.random.key(5), (3, 512)) * jnp.exp2(jnp.arange(3.0) * 4 - 4)[:, None]
    records, qdqs = _encode(x)
    decoded = _decode(records)
    for (data, scale), (dec, dec_f8), qdq, (nd, ns) in zip(records, decoded, qdqs, ((512, 16), (256, 32), (256, 16))):
        assert data.dtype == scale.dtype == jnp.uint8 and data.shape == (3, nd) and scale.shape == (3, ns)
        np.testing.assert_array_equal(np.asarray(dec), np.asarray(qdq))
        np.testing.assert_array_equal(np.asarray(dec_f8), np.asarray(qdq))


def test_e4m3_decode_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(quant.e4m3_decode(jnp.asarray(b))),
                                  b.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(quant.e2m1_decode_packed(jnp.asarray(b))).reshape(256, 2),
                                  quant.E2M1_TABLE[np.stack([b & 15, b >> 4], -1)])


def test_ue8m0_bytes_decode_as_the_reference():
    """Every byte b is 2^(b-127) as torch.float8_e8m0fnu reads it (the PyTorch reference's scale dtype; OCP MX
    E8M0; ml_dtypes' float8_e8m0fnu is the same format): byte 0 is 2^-127, not 0; byte 255 is NaN. The encoder
    inverts it on all 256 bytes."""
    b = np.arange(256, dtype=np.uint8)
    got = np.asarray(quant.ue8m0_decode(jnp.asarray(b)))
    np.testing.assert_array_equal(got, b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    assert got[0] == 2.0**-127 and got[1] == 2.0**-126 and got[254] == 2.0**127 and np.isnan(got[255])
    np.testing.assert_array_equal(np.asarray(quant.ue8m0_encode(jnp.asarray(got))), b)
