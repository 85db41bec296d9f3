"""Runs the straight-line inline-PTX blocks of our decoders on numpy uint32 arrays, so CPU tests check the PTX
text the GPU runs (the Mosaic GPU interpreter cannot run `inline_mgpu`).

Covers the instructions those blocks use: mov / shl / shr / and / or .b32, shr.u32, shf.l.wrap.b32, add.u32,
set.eq.u32.u32, mul.lo / mul.hi / mul.wide .u32, mov.b64 {lo, hi} / mov.b32 {lo, hi} (a register's halves),
prmt.b32 (default mode), mul.rn.bf16x2 (each half rounded to nearest even, subnormals kept, as sm_90 does), and the float steps of the
e4m3 decoders: cvt.rn.f16x2.e4m3x2, cvt.f32.f16, mul.f32 (no flush), cvt.rn.bf16x2.f32 (a -> high half).
Anything else raises, so a decoder that starts using another instruction fails its test until the emulator
learns it.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

_M32 = np.uint64(0xFFFFFFFF)


def _bf16_halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    return lo, hi


def _bf16_pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    # bf16 x bf16 has <= 16 significant bits: exact in float32 (the products here stay far above 2^-149), so
    # one rounding float32 -> bf16 is the instruction's rounding
    lo = lo.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint64)
    hi = hi.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint64)
    return lo | (hi << np.uint64(16))


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(np.asarray(x, np.uint64) & _M32, np.uint32).view(np.float32)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(np.asarray(x, np.uint64) & np.uint64(0xFFFF), np.uint16).view(np.float16)


def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    out = np.zeros(np.broadcast(a, b, sel).shape, np.uint64)  # constant words select per lane too
    for i in range(4):
        s = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        if np.any(s & np.uint64(8)):
            raise NotImplementedError("prmt sign-replicate selectors are not emulated")
        src = np.where(s < 4, a, b)
        byte = (src >> (np.uint64(8) * (s & np.uint64(3)))) & np.uint64(0xFF)
        out |= byte << np.uint64(8 * i)
    return out


def run(ptx: str, inputs: dict[int, np.ndarray], n_out: int) -> list[np.ndarray]:
    """inputs: {operand number: uint32 array}; returns operands $0..$(n_out-1) as uint32 arrays."""
    regs: dict[str, np.ndarray] = {f"${k}": np.asarray(v, np.uint64) & _M32 for k, v in inputs.items()}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return np.uint64(int(tok, 0))
        raise KeyError(f"operand {tok!r} read before it was written")

    body = ptx.strip().removeprefix("{").removesuffix("}")
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b64" and rest.lstrip().startswith("{"):  # {lo, hi} <- a 64-bit register
            halves, src64 = rest.split("}")
            lo, hi = [t.strip() for t in halves.strip(" {").split(",")]
            w = val(src64.strip(" ,"))
            regs[lo], regs[hi] = w & _M32, w >> np.uint64(32)
            continue
        if op == "mov.b32" and rest.lstrip().startswith("{"):  # {lo, hi} <- a 32-bit register
            halves, src32 = rest.split("}")
            lo, hi = [t.strip() for t in halves.strip(" {").split(",")]
            w = val(src32.strip(" ,"))
            regs[lo], regs[hi] = w & np.uint64(0xFFFF), (w >> np.uint64(16)) & np.uint64(0xFFFF)
            continue
        dst, *src = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in src]
        if op == "mov.b32":
            r = a[0]
        elif op == "shl.b32":
            r = a[0] << a[1]
        elif op in ("shr.b32", "shr.u32"):
            r = a[0] >> a[1]
        elif op == "shf.l.wrap.b32":  # funnel shift of {a[1]:a[0]} left by a[2] mod 32, upper word
            n = a[2] & np.uint64(31)
            r = (((a[1] << np.uint64(32)) | a[0]) << n) >> np.uint64(32)
        elif op == "add.u32":
            r = a[0] + a[1]
        elif op == "set.eq.u32.u32":  # all ones where equal
            r = np.where(a[0] == a[1], _M32, np.uint64(0))
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "mul.lo.u32":
            r = a[0] * a[1]
        elif op == "mul.hi.u32":
            r = (a[0] * a[1]) >> np.uint64(32)
        elif op == "mul.wide.u32":  # the whole 64-bit product, kept unmasked below
            regs[dst] = np.asarray(a[0] * a[1], np.uint64)
            continue
        elif op == "prmt.b32":
            r = _prmt(*a)
        elif op == "mul.rn.bf16x2":
            (xl, xh), (yl, yh) = _bf16_halves(a[0]), _bf16_halves(a[1])
            r = _bf16_pack(xl * yl, xh * yh)
        elif op == "cvt.rn.f16x2.e4m3x2":  # byte i of the 16-bit operand -> half i (exact)
            b = np.stack([a[0] & np.uint64(0xFF), (a[0] >> np.uint64(8)) & np.uint64(0xFF)], -1)
            h = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16).view(np.uint16)
            r = h[..., 0].astype(np.uint64) | (h[..., 1].astype(np.uint64) << np.uint64(16))
        elif op == "cvt.f32.f16":
            r = _f16(a[0]).astype(np.float32).view(np.uint32)
        elif op == "mul.f32":
            r = (_f32(a[0]) * _f32(a[1])).view(np.uint32)
        elif op == "cvt.rn.bf16x2.f32":
            r = _bf16_pack(_f32(a[1]), _f32(a[0]))
        else:
            raise NotImplementedError(f"instruction {op!r} is not emulated")
        regs[dst] = np.asarray(r, np.uint64) & _M32
    return [regs[f"${k}"].astype(np.uint32) for k in range(n_out)]


def bf16_values(x: np.ndarray) -> np.ndarray:
    """uint32 bf16x2 registers [...] -> float32 [..., 2] (low half first)."""
    lo, hi = _bf16_halves(np.asarray(x, np.uint64))
    return np.stack([lo, hi], -1)
