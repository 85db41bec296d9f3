"""Linear layer with the release's FP8 weights (e4m3 + UE8M0 per 32x32 block) for decode-sized batches.

y = x @ W^T, x bf16 [M, K] with M <= MAX_ROWS, W `Fp8Weight` [N, K] -> bf16 [M, N], float32 accumulation.

Why: XLA dequantizes a block-scaled FP8 weight into a bf16 copy before its GEMM reads it (1 byte read, 2
written, 2 read again per weight), which made the release's FP8 linears slower than bf16 ones on the H200
(docs/PERFORMANCE.md, "Release weight formats"). This path reads each weight byte once: it runs the grouped
expert GEMM's Mosaic GPU kernel (`expert_gemm._build_kernel`, weights as the wgmma M operand, tokens as N)
with an FP8 decoder in registers instead of the FP4 one, as a single group.

Kernel layout (`PreparedFp8`): within every 16 inputs the bytes are reordered so that 32-bit word c holds
inputs (2c, 2c+1, 8+2c, 9+2c): the two bf16x2 A-fragment registers lane c needs. The decoder moves each byte to
the high byte of a bf16 half (`prmt`), keeps the sign at bit 15 and shifts exponent|mantissa down to bits
4..10, which is e4m3 * 2^-120 exactly (subnormals included), then multiplies by 2^(s-7) (`mul.rn.bf16x2`,
exact). Scales: the block's UE8M0 byte for every row, transposed to [K/32, N] (a TMA box per tile; 1/32 of
the weight bytes). Limits: N % 128 == 0, K % 128 == 0, scale bytes <= MAX_SCALE_BYTE.

Split K: a kernel work item is 128 output rows over all of K, so a linear with few rows (wq_a: N=1280, 10
items) would leave most of the 132 SMs idle. `prepare_fp8_linear` cuts K into S slices stored as S groups
[S, N, K/S] (S chosen from the shape, see `splits`); the kernel runs them as S groups of the same token tile
and the S partial results are written in float32 (as y^T [N, S * tm], the accumulator's orientation) and
summed outside, so the result is rounded to bf16 once, as XLA's dot rounds it. (The first version wrote bf16
partials: 0.3-0.6% of the largest output from XLA on the H200, and an engine check that failed at one decode
step; docs/KERNELS_EXPERT_GEMM.md, "FP8 linears".)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv41.quant import Fp8Weight
from pallas_kernels import expert_gemm as eg

MAX_ROWS = 128  # one token tile (the wgmma N operand); larger batches (prefill) take the XLA path
MAX_SCALE_BYTE = 134  # 2^(s-7) must be a finite bf16
TN, TK = 128, 128
MIN_STEPS = 4  # k-steps a split keeps at least (each work item runs a pipeline of K/S/TK steps)


def splits(n: int, k: int, num_sms: int = 132) -> int:
    """K slices S: the fewest (a divisor of K/128 leaving >= MIN_STEPS steps each) giving every SM an item."""
    steps = k // TK
    best = 1
    for s_ in range(1, steps + 1):
        if steps % s_ or steps // s_ < MIN_STEPS:
            continue
        best = s_
        if s_ * (n // TN) >= num_sms:
            break
    return best


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedFp8:
    """An FP8 linear weight [N, K] in the kernel layout, K cut into S slices: `weight` uint8 [S, N, K/S] (e4m3
    bytes, reordered per 16 inputs), `scale_t` uint8 [S, K/S/32, N] (UE8M0 per row and 32 inputs). `interpret`
    (static): run the kernel in the Mosaic GPU interpreter (CPU tests). `dequantize` gives the dense weight, so a
    path without the kernel still works."""

    weight: jax.Array
    scale_t: jax.Array
    interpret: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        s_, n, ks = self.weight.shape
        return (n, s_ * ks)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return unprepare_fp8_linear(self).dequantize(dtype)


def supported(w) -> bool:
    """Whether `prepare_fp8_linear` takes this weight (a 2-D Fp8Weight with N and K multiples of 128)."""
    return (isinstance(w, Fp8Weight) and w.weight.ndim == 2 and w.weight.shape[0] % TN == 0
            and w.weight.shape[1] % TK == 0)


def _perm_to_kernel(b: jax.Array) -> jax.Array:
    *lead, k = b.shape
    c = b.reshape(*lead, k // 16, 2, 4, 2)  # natural index 8u + 2c + v -> axes (u, c, v)
    return jnp.moveaxis(c, -3, -2).reshape(*lead, k)  # (c, u, v): byte 4c + 2u + v


def prepare_fp8_linear(w: Fp8Weight, interpret: bool = False, check: bool = True,
                       num_splits: int | None = None) -> PreparedFp8:
    """Fp8Weight [N, K] -> PreparedFp8 (once, at load). num_splits: K slices (default `splits(N, K)`)."""
    if not supported(w):
        raise ValueError(f"the FP8 linear kernel needs a 2-D Fp8Weight with N, K multiples of 128, got "
                         f"{type(w).__name__} {getattr(w, 'shape', None)}")
    n, k = w.weight.shape
    if check and not isinstance(w.scale, jax.core.Tracer):
        smax = int(jnp.max(w.scale))
        if smax > MAX_SCALE_BYTE:
            raise ValueError(f"UE8M0 scale byte {smax} > {MAX_SCALE_BYTE} is outside the FP8 kernel's range")
    s_ = num_splits or splits(n, k, eg._num_sms())
    if (k // TK) % s_:
        raise ValueError(f"num_splits={s_} must divide K/{TK}={k // TK}")
    raw = jax.lax.bitcast_convert_type(w.weight, jnp.uint8).reshape(n, s_, k // s_)
    rows = jnp.repeat(w.scale, 32, axis=0)[:n, : k // 32].reshape(n, s_, k // 32 // s_)  # the block's byte per row
    return PreparedFp8(_perm_to_kernel(jnp.swapaxes(raw, 0, 1)), jnp.transpose(rows, (1, 2, 0)), interpret)


def unprepare_fp8_linear(p: PreparedFp8) -> Fp8Weight:
    n, k = p.shape
    raw = jnp.swapaxes(eg._perm8_from_kernel(p.weight), 0, 1).reshape(n, k)
    rows = jnp.transpose(p.scale_t, (2, 0, 1)).reshape(n, k // 32)
    return Fp8Weight(jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn), rows[::32])  # a block's rows share it


def fp8_linear_reference(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """float32 throughout, HIGHEST precision."""
    return jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w.dequantize(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def _config(tm: int, k_iters: int, out_bytes: int = 2) -> eg.KernelConfig:
    """Pipeline depth that fits shared memory (x tile, weight tile, scales a stage; the output tiles once),
    preferring one that divides the steps so an SM's items chain."""
    stage = tm * TK * 2 + TN * TK + TK // 32 * TN
    fits = [st for st in (4, 5, 3, 2) if st * stage + 2 * tm * 64 * out_bytes <= 200 * 1024]
    stages = next((st for st in fits if k_iters % st == 0), fits[0])
    return eg.KernelConfig(tm=tm, tk=TK, num_wgs=2, stages=stages, chain=True)


def fp8_linear(x: jax.Array, w: PreparedFp8, config: eg.KernelConfig | None = None) -> jax.Array:
    """x bf16 [M, K] (M <= MAX_ROWS) -> bf16 [M, N] through the kernel (w.interpret: the interpreter)."""
    m, k = x.shape
    s_, n, ks = w.weight.shape
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows > MAX_ROWS={MAX_ROWS}: use the XLA path (dequantize + dot) for prefill")
    if s_ * ks != k:
        raise ValueError(f"x has K={k}, weight has K={s_ * ks}")
    tm = max(8, -(-m // 8) * 8)
    # token tile t = (slice t's inputs of every row): group t, row block t
    xs = jnp.pad(x.astype(jnp.bfloat16), ((0, tm - m), (0, 0))).reshape(tm, s_, ks)
    xs = jnp.swapaxes(xs, 0, 1).reshape(s_ * tm, ks)
    # K slices write float32 partials, so the result is rounded once, as XLA's dot rounds it
    out_dtype = jnp.float32 if s_ > 1 else jnp.bfloat16
    cfg = config or _config(tm, ks // TK, jnp.dtype(out_dtype).itemsize)
    tiles = jnp.arange(s_, dtype=jnp.int32)
    call = eg._build_kernel(s_ * tm, ks, n, s_, s_, cfg, w.interpret, fmt="fp8", out_dtype=out_dtype)
    y = call(jnp.full((1,), s_, jnp.int32), tiles, tiles, xs, w.weight, w.scale_t)
    if s_ == 1:
        return y[:m]  # [tm, N] bf16
    return y.reshape(n, s_, tm).sum(1).T[:m].astype(jnp.bfloat16)  # y^T [N, S * tm] float32
