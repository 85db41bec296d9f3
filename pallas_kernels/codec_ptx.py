"""In-kernel twins of dsv41.quant's decoders: the register-level PTX the Mosaic GPU producers run.

dsv41.quant is the one codec; everything jnp-level (references, interpreter paths, host helpers) calls it. A
kernel body cannot: it dequantizes 16-byte words in registers with integer / `prmt` / `cvt` instructions. Each
format's register decoder is written once, here, and named after the quant.py function it must equal bit for
bit (tests/pallas_kernels/test_codec_ptx.py runs the PTX text in tests/pallas_kernels/ptx_emulator.py on every
byte value / code against quant.py; on the GPU the kernels' `dequant_probe`s check the same against the
references). Operands are PTX `$n` numbers: outputs first, then inputs, as `mosaic_gpu.utils.inline_ptx` binds them.

Register layouts (bf16x2: low half = the lower-addressed element):
- `FP4_WORD_PTX`: $4 one u32 of 8 packed e2m1 codes (byte i = elements 2i low nibble, 2i+1 high), $5 a bf16x2
  scale (the same scale in both halves) -> $0..$3 bf16x2 of elements (0,1) (2,3) (4,5) (6,7), each
  `quant.e2m1_values(code) * scale` rounded to bf16 (exact: e2m1 has 1 mantissa bit, the scale is a power of two
  or an e4m3 value, whose 4 significant bits times 2 fit bf16's 8).
- `E4M3_SCALE_PTX`: $2 a u32 holding two e4m3 scale bytes in its low 16 bits -> $0, $1 bf16x2 with
  `quant.e4m3_decode` of the low / high byte in both halves (exact: e4m3 fits bf16).
- `E4M3_WORD_PTX`: $2 one u32 of 4 e4m3 bytes, $3 an f32 scale -> $0, $1 bf16x2 of elements (0,1), (2,3):
  `quant.e4m3_decode(byte) * scale` rounded to bf16.
- `UE8M0_F32_PTX`: $1 a UE8M0 byte (u32) -> $0 the f32 bits of `quant.ue8m0_decode(byte)`.
- `UE8M0_BF16X2_PTX`: $1 a UE8M0 byte (u32) -> $0 bf16x2 with `quant.ue8m0_decode(byte)` in both halves
  (a power of two: exact in bf16).
"""

from __future__ import annotations

# e2m1 by byte table: `prmt` picks each code's bf16 high byte (sign-less) and low byte from two constant words
# indexed by the 3-bit magnitude; the sign bits (3 and 7 of each byte) are moved to bit 7 of the high bytes.
FP4_WORD_PTX = """{
.reg .b32 sa, sb, ha, la, hb, lb, so, se, sga, sgb, t0, t1;
and.b32 sa, $4, 0x7777;
shr.u32 sb, $4, 16;
and.b32 sb, sb, 0x7777;
prmt.b32 ha, 0x3F3F3F00, 0x40404040, sa;
prmt.b32 la, 0xC0800000, 0xC0804000, sa;
prmt.b32 hb, 0x3F3F3F00, 0x40404040, sb;
prmt.b32 lb, 0xC0800000, 0xC0804000, sb;
and.b32 so, $4, 0x80808080;
shl.b32 se, $4, 4;
and.b32 se, se, 0x80808080;
prmt.b32 sga, se, so, 0x5140;
prmt.b32 sgb, se, so, 0x7362;
or.b32 ha, ha, sga;
or.b32 hb, hb, sgb;
prmt.b32 t0, la, ha, 0x5140;
prmt.b32 t1, la, ha, 0x7362;
mul.rn.bf16x2 $0, t0, $5;
mul.rn.bf16x2 $1, t1, $5;
prmt.b32 t0, lb, hb, 0x5140;
prmt.b32 t1, lb, hb, 0x7362;
mul.rn.bf16x2 $2, t0, $5;
mul.rn.bf16x2 $3, t1, $5;
}"""

E4M3_SCALE_PTX = """{
.reg .b16 s16, x0, x1, hi16;
.reg .b32 h2;
.reg .f32 f0, f1;
mov.b32 {s16, hi16}, $2;
cvt.rn.f16x2.e4m3x2 h2, s16;
mov.b32 {x0, x1}, h2;
cvt.f32.f16 f0, x0;
cvt.f32.f16 f1, x1;
cvt.rn.bf16x2.f32 $0, f0, f0;
cvt.rn.bf16x2.f32 $1, f1, f1;
}"""

E4M3_WORD_PTX = """{
.reg .b16 l, h, x0, x1, x2, x3;
.reg .b32 a, b;
.reg .f32 f0, f1, f2, f3;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;
mov.b32 {x0, x1}, a;
mov.b32 {x2, x3}, b;
cvt.f32.f16 f0, x0;
cvt.f32.f16 f1, x1;
cvt.f32.f16 f2, x2;
cvt.f32.f16 f3, x3;
mul.f32 f0, f0, $3;
mul.f32 f1, f1, $3;
mul.f32 f2, f2, $3;
mul.f32 f3, f3, $3;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}"""

# A UE8M0 byte is the biased exponent of its power of two: shifted into float32's exponent field. Bytes 0 and 255
# also set the mantissa's top bit (quant.ue8m0_decode: 2^-127, NaN): (b + 1) & 0xFE is 0 for exactly those two,
# and set.eq turns that into an all-ones mask.
UE8M0_F32_PTX = """{
.reg .b32 t;
add.u32 t, $1, 1;
and.b32 t, t, 0xFE;
set.eq.u32.u32 t, t, 0;
and.b32 t, t, 0x400000;
shl.b32 $0, $1, 23;
or.b32 $0, $0, t;
}"""

# The same in both bf16 halves (exponent fields at bits 7 and 23): b * 0x00800080 = (b << 7) | (b << 23) for
# b <= 255, and the mantissa top bits of both halves for bytes 0 and 255.
UE8M0_BF16X2_PTX = """{
.reg .b32 t;
add.u32 t, $1, 1;
and.b32 t, t, 0xFE;
set.eq.u32.u32 t, t, 0;
and.b32 t, t, 0x00400040;
mul.lo.u32 $0, $1, 0x00800080;
or.b32 $0, $0, t;
}"""


def ue8m0_f32(byte):
  """MLIR i32 value holding a UE8M0 byte -> MLIR f32 value `quant.ue8m0_decode(byte)` (inside inline_mgpu)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic.gpu import utils as mu

  bits = mu.inline_ptx(UE8M0_F32_PTX, byte, result_types=ir.IntegerType.get_signless(32))
  return arith.bitcast(ir.F32Type.get(), bits)


def ue8m0_bf16x2(byte):
  """MLIR i32 value holding a UE8M0 byte -> MLIR i32 bf16x2 (`quant.ue8m0_decode(byte)`, twice)."""
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import utils as mu

  return mu.inline_ptx(UE8M0_BF16X2_PTX, byte, result_types=ir.IntegerType.get_signless(32))
