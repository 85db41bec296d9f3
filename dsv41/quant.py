"""Number formats of V4.1: FP8 e4m3 with UE8M0 scales, MXFP4 (e2m1 + UE8M0), NVFP4-like (e2m1 + E4M3/16).

Three kinds of function live here, all pure jnp (they run on host numpy arrays too):
- quantize-dequantize (`*_qdq`): the reference's QAT numerics, applied to activations and caches;
- pack/unpack: the byte layouts of the release's weights;
- record encode/decode (`fp8_*`, `kv_fp4_*`, `mxfp4_*` `_encode` / `_decode`): the serving KV pool's bytes.
This is the only codec: kernels' references and interpreter paths call it, and the register-level decoders inside
GPU kernels (pallas_kernels/codec_ptx) are tested bit for bit against it.
Spec: shared/spec/ARCHITECTURE.md §4. Scales follow the official kernels bit for bit: a UE8M0 scale is
2^ceil(log2(amax * (1/max))) read off the float32 bits, so ties and denormals match.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# signed 4-bit code -> value; bit 3 is the sign
E2M1_TABLE = np.concatenate([E2M1_GRID, -E2M1_GRID])
# round-to-nearest-even boundaries between consecutive codes; an exact tie rounds up only where the
# upper code is even (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0)
_E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_E2M1_TIE_UP = np.array([False, True, False, True, False, True, False])


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Which of the reference's rounding points the model applies.

    act_quant: FP8 per-32 quantize-dequantize of the input of every linear whose release weight is FP8/FP4.
    kv_quant: FP8 SWA cache, FP4 (E4M3/16) compressed KV and MXFP4 indexer Q/K.
    bf16_probs: attention probabilities rounded to bf16 before P.V, as the reference kernel does.
    dtype: activation dtype between ops ('bfloat16' as released; 'float32' for tight equivalence tests).
    """

    act_quant: bool = True
    kv_quant: bool = True
    bf16_probs: bool = True
    dtype: str = "bfloat16"

    @property
    def jdtype(self):
        return jnp.dtype(self.dtype)


REFERENCE = Numerics()
EXACT_F32 = Numerics(act_quant=False, kv_quant=False, bf16_probs=False, dtype="float32")


def _block(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def pow2_scale(amax: jax.Array, max_value: float) -> jax.Array:
    """2^ceil(log2(amax * (1/max_value))) from the float32 bits (the kernels' fast_round_scale)."""
    x = amax.astype(jnp.float32) * jnp.float32(1.0 / max_value)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & ((1 << 23) - 1)
    e = exp + (man != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(e << 23, jnp.float32)


def e4m3(x: jax.Array) -> jax.Array:
    """float32 -> float8_e4m3fn, round to nearest even, saturating at +-448 (a plain cast gives NaN). For values
    that stay float (a quantize-dequantize), `e4m3_round`."""
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def e4m3_round(x: jax.Array) -> jax.Array:
    """float32 -> float32 holding `e4m3(x)`'s value, without a float8 conversion.

    XLA's GPU compiler removes a float32 -> float8 -> float32 convert pair (SimplifyFPConversions, with excess
    precision allowed, the default), so a quantize-dequantize written with the cast is no rounding at all on
    the GPU. Here the rounding is arithmetic: e4m3's quantum at x is 2^(max(e, -6) - 3) (e = x's binary exponent;
    -6 the smallest normal's, below it the subnormals' fixed 2^-9), x / quantum is exact and rounds to nearest
    even, and the product is exact again."""
    x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    exp = (jax.lax.bitcast_convert_type(x, jnp.int32) >> 23) & 0xFF  # float32's biased exponent
    quantum = jax.lax.bitcast_convert_type((jnp.maximum(exp, 127 - 6) - 3) << 23, jnp.float32)
    return jnp.round(x / quantum) * quantum


def e2m1_codes(v: jax.Array) -> jax.Array:
    """float32 in [-6, 6] -> 4-bit e2m1 codes (uint8, bit 3 = sign), round to nearest even."""
    mag = jnp.abs(v)[..., None]
    code = jnp.sum(mag > _E2M1_MIDS, -1) + jnp.sum((mag == _E2M1_MIDS) & _E2M1_TIE_UP, -1)
    return code.astype(jnp.uint8) | (jnp.signbit(v).astype(jnp.uint8) << 3)


def e2m1_values(codes: jax.Array) -> jax.Array:
    """4-bit codes -> float32 values. Decoded arithmetically (exponent = bits 1-2, mantissa = bit 0), not by a
    table gather: elementwise code shards and fuses like any other elementwise op."""
    c = codes.astype(jnp.int32)
    e, m = (c >> 1) & 3, (c & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * jnp.exp2((e - 1).astype(jnp.float32)))
    return jnp.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., 2n] -> bytes [..., n]; element 2k in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """bytes [..., n] -> uint8 codes [..., 2n]."""
    p = packed.astype(jnp.uint8)
    return jnp.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


# ---- FP8 (e4m3, UE8M0 per 32) -----------------------------------------------------------------------


def _fp8_scales(xg: jax.Array) -> jax.Array:
    """Blocks [..., n/block, block] float32 -> their pow2 scales [..., n/block]; amax floor 1e-4 as in the kernel."""
    return pow2_scale(jnp.maximum(jnp.max(jnp.abs(xg), -1), 1e-4), FP8_MAX)


def fp8_quantize(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """x [..., n] -> (e4m3 [..., n], float32 pow2 scales [..., n/block])."""
    xg = _block(x.astype(jnp.float32), block)
    s = _fp8_scales(xg)
    q = e4m3(xg / s[..., None])
    return q.reshape(x.shape), s


def fp8_dequantize(q: jax.Array, s: jax.Array, block: int = 32) -> jax.Array:
    qg = _block(q.astype(jnp.float32), block)
    return (qg * s.astype(jnp.float32)[..., None]).reshape(q.shape)


def round_to(x: jax.Array, dtype) -> jax.Array:
    """x rounded to dtype's precision (nearest even), kept in x's float type. A plain astype(bf16).astype(f32)
    pair is not a rounding under jit: XLA's excess-precision simplification removes it, so the reference
    kernels' bf16 rounding steps are written with this."""
    fi = jnp.finfo(dtype)
    if jnp.finfo(x.dtype).nmant <= fi.nmant:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def fp8_qdq(x: jax.Array, block: int = 32) -> jax.Array:
    """The reference's act_quant(..., inplace=True): FP8 round trip, result in x's dtype (`fp8_quantize` then
    `fp8_dequantize`'s values, rounded by `e4m3_round`: a float8 cast pair is dropped by XLA on the GPU)."""
    xg = _block(x.astype(jnp.float32), block)
    s = _fp8_scales(xg)[..., None]
    return (e4m3_round(xg / s) * s).reshape(x.shape).astype(x.dtype)


# ---- FP4 e2m1 with UE8M0/32 (MXFP4) or E4M3/16 scales -------------------------------------------------


def fp4_scales(xg: jax.Array, e4m3_scales: bool) -> jax.Array:
    amax = jnp.max(jnp.abs(xg), -1)
    if e4m3_scales:  # compressed KV: amax/6 rounded to E4M3, floor keeps an all-zero group's scale nonzero
        return e4m3_round(jnp.maximum(amax, 6 * 2.0**-9) / FP4_MAX)
    return pow2_scale(jnp.maximum(amax, 6 * 2.0**-126), FP4_MAX)


def fp4_quantize(x: jax.Array, block: int, e4m3_scales: bool) -> tuple[jax.Array, jax.Array]:
    """x [..., n] -> (packed bytes uint8 [..., n/2], float32 scales [..., n/block])."""
    xg = _block(x.astype(jnp.float32), block)
    s = fp4_scales(xg, e4m3_scales)
    codes = e2m1_codes(jnp.clip(xg / s[..., None], -FP4_MAX, FP4_MAX))
    return pack_nibbles(codes.reshape(x.shape)), s


def fp4_dequantize(packed: jax.Array, s: jax.Array, block: int) -> jax.Array:
    v = e2m1_values(unpack_nibbles(packed))
    vg = _block(v, block)
    return (vg * s.astype(jnp.float32)[..., None]).reshape(v.shape)


def fp4_qdq(x: jax.Array, block: int, e4m3_scales: bool) -> jax.Array:
    """The reference's fp4_act_quant(..., inplace=True), result in x's dtype."""
    xg = _block(x.astype(jnp.float32), block)
    s = fp4_scales(xg, e4m3_scales)[..., None]
    v = e2m1_values(e2m1_codes(jnp.clip(xg / s, -FP4_MAX, FP4_MAX))) * s
    return v.reshape(x.shape).astype(x.dtype)


def mxfp4_qdq(x: jax.Array) -> jax.Array:
    """Indexer Q/K numerics: e2m1 with a UE8M0 scale per 32."""
    return fp4_qdq(x, 32, e4m3_scales=False)


def kv_fp4_qdq(x: jax.Array) -> jax.Array:
    """Compressed main-KV numerics: e2m1 with an E4M3 scale per 16, no global scale."""
    return fp4_qdq(x, 16, e4m3_scales=True)


# ---- UE8M0 bytes ----------------------------------------------------------------------------------------


def ue8m0_encode(s: jax.Array) -> jax.Array:
    """Power-of-two float32 scales -> UE8M0 bytes (biased exponent)."""
    bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF).astype(jnp.uint8)


def ue8m0_decode(b: jax.Array) -> jax.Array:
    """UE8M0 bytes [...] -> float32 [...] 2^(b-127) for every byte, as the reference reads its scales
    (torch.float8_e8m0fnu -> float; OCP MX E8M0): byte 0 is 2^-127, a float32 subnormal (not 0), and byte 255 is
    NaN. Both become float32 by setting the mantissa's top bit under the exponent field b (0 -> 2^-127,
    255 -> a quiet NaN); every other byte is the exponent field alone. `ue8m0_encode` inverts it on all 256.
    (XLA:CPU flushes subnormal operands, so there a value times 2^-127 is 0; XLA:GPU and the kernels keep it.)"""
    b = b.astype(jnp.int32)
    edge = jnp.where((b == 0) | (b == 255), 1 << 22, 0)
    return jax.lax.bitcast_convert_type((b << 23) | edge, jnp.float32)


# ---- byte records of the KV pool (spec §4 table) --------------------------------------------------------
# Each `*_encode` returns the bytes the pool stores and its `*_decode` reads them back to float32; the values are
# those of `fp8_qdq` / `kv_fp4_qdq` / `mxfp4_qdq`. Decoders take the raw uint8 bytes or, where the byte is a
# float8 (e4m3 values and scales), that float8 dtype too. A decode fed straight by an encode in one XLA:GPU
# program is no rounding (the float8 convert pair is folded through the bitcasts): within a program, `*_qdq`.


def as_bytes(x: jax.Array) -> jax.Array:
    """A 1-byte array (uint8, float8_e4m3fn, ...) -> its uint8 bits (a bitcast, no copy)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.uint8:
        return x
    if x.dtype.itemsize != 1:
        raise TypeError(f"expected a 1-byte dtype, got {x.dtype}")
    return jax.lax.bitcast_convert_type(x, jnp.uint8)


def e4m3_decode(b: jax.Array) -> jax.Array:
    """e4m3 bytes (uint8 or float8_e4m3fn) [...] -> float32 [...] (exact; 0x7F / 0xFF are NaN)."""
    return jax.lax.bitcast_convert_type(as_bytes(b), jnp.float8_e4m3fn).astype(jnp.float32)


def e2m1_decode_packed(packed: jax.Array) -> jax.Array:
    """Packed e2m1 bytes [..., n] (element 2k in the low nibble) -> float32 values [..., 2n], scale 1."""
    return e2m1_values(unpack_nibbles(as_bytes(packed)))


def fp8_encode(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """SWA record: x [..., n] -> (e4m3 bytes uint8 [..., n], UE8M0 bytes uint8 [..., n/block])."""
    q, s = fp8_quantize(x, block)
    return as_bytes(q), ue8m0_encode(s)


def fp8_decode(q: jax.Array, s: jax.Array, block: int = 32) -> jax.Array:
    """SWA record: e4m3 bytes [..., n] + UE8M0 bytes [..., n/block] -> float32 [..., n]."""
    return fp8_dequantize(e4m3_decode(q), ue8m0_decode(s), block)


def kv_fp4_encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Compressed main-KV record: x [..., n] -> (packed e2m1 uint8 [..., n/2], E4M3 scale bytes uint8 [..., n/16]).
    The scales are exact e4m3 values (`fp4_scales` rounds them by arithmetic), so the cast to bytes is exact and
    the codes were cut against the scale that is stored."""
    packed, s = fp4_quantize(x, 16, e4m3_scales=True)
    return packed, as_bytes(e4m3(s))


def kv_fp4_decode(packed: jax.Array, s: jax.Array) -> jax.Array:
    """Compressed main-KV record: packed e2m1 [..., n/2] + E4M3 scales (bytes or float8) [..., n/16] -> f32 [..., n]."""
    return fp4_dequantize(as_bytes(packed), e4m3_decode(s), 16)


def mxfp4_encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Indexer-key record: x [..., n] -> (packed e2m1 uint8 [..., n/2], UE8M0 bytes uint8 [..., n/32])."""
    packed, s = fp4_quantize(x, 32, e4m3_scales=False)
    return packed, ue8m0_encode(s)


def mxfp4_decode(packed: jax.Array, s: jax.Array) -> jax.Array:
    """Indexer-key record: packed e2m1 [..., n/2] + UE8M0 bytes [..., n/32] -> float32 [..., n]."""
    return fp4_dequantize(as_bytes(packed), ue8m0_decode(s), 32)


# ---- weights in the release format ----------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A linear weight as released: e4m3 [..., out, in] with one UE8M0 scale per 32x32 block.

    `scale` holds the raw UE8M0 bytes as uint8 [..., ceil(out/32), ceil(in/32)].
    """

    weight: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        w = self.weight.astype(jnp.float32)
        s = ue8m0_decode(self.scale)
        out, inp = w.shape[-2], w.shape[-1]
        s = jnp.repeat(jnp.repeat(s, 32, axis=-2)[..., :out, :], 32, axis=-1)[..., :inp]
        return (w * s).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp4Weight:
    """A routed-expert weight as released: e2m1 packed two per byte along `in`, uint8 [..., out, in/2],
    with one UE8M0 scale per 32 inputs, uint8 [..., out, in/32]."""

    weight: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 2)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return fp4_dequantize(self.weight, ue8m0_decode(self.scale), 32).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """An Engram table as released: e4m3 rows [rows, d] with a UE8M0 scale per 32 along the row, uint8
    [rows, d/32]. Read by row id; rows dequantize on lookup (to bf16, as the reference does)."""

    weight: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @staticmethod
    def row_bytes(d: int) -> int:
        """Bytes of one row of d values: d e4m3 bytes and a scale byte per 32."""
        return d + d // 32

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return fp8_dequantize(self.weight, ue8m0_decode(self.scale), 32).astype(dtype)


def quantize_fp8_weight(w: jax.Array) -> Fp8Weight:
    """[..., out, in] float -> Fp8Weight with pow2 scales per 32x32 block (amax/448 rounded up)."""
    w = jnp.asarray(w, jnp.float32)
    out, inp = w.shape[-2], w.shape[-1]
    po, pi = -out % 32, -inp % 32
    wp = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, po), (0, pi)])
    blocks = wp.reshape(*w.shape[:-2], (out + po) // 32, 32, (inp + pi) // 32, 32)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    s = pow2_scale(jnp.maximum(amax, 1e-30), FP8_MAX)
    q = e4m3(blocks / s[..., :, None, :, None]).reshape(wp.shape)[..., :out, :inp]
    return Fp8Weight(q, ue8m0_encode(s))


def quantize_fp4_weight(w: jax.Array) -> Fp4Weight:
    """[..., out, in] float -> Fp4Weight (MXFP4 along `in`)."""
    packed, s = fp4_quantize(jnp.asarray(w, jnp.float32), 32, e4m3_scales=False)
    return Fp4Weight(packed, ue8m0_encode(s))


def is_quantized(w) -> bool:
    return isinstance(w, (Fp8Weight, Fp4Weight))


def dense(w, dtype=jnp.float32) -> jax.Array:
    """Any weight representation (incl. a kernel layout with `dequantize`) -> a dense array."""
    if hasattr(w, "dequantize"):
        return w.dequantize(dtype)
    return jnp.asarray(w).astype(dtype)
