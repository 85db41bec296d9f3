"""Linear layer with the release's FP8 weights (e4m3 + UE8M0 per 32x32 block) for decode-sized batches.

y = x @ W^T, x bf16 [M, K] with M <= MAX_ROWS, W `Fp8Weight` [N, K] -> bf16 [M, N], float32 accumulation.

Why: XLA dequantizes a block-scaled FP8 weight into a bf16 copy before its GEMM reads it (1 byte read, 2
written, 2 read again per weight), which made the release's FP8 linears slower than bf16 ones on the H200
(docs/PERFORMANCE.md, decode with release weights). This path reads each weight byte once: it runs the grouped
expert GEMM's Mosaic GPU kernel (`expert_gemm._build_kernel`, weights as the wgmma M operand, tokens as N;
warp-level mma.sync up to 8 rows) with an FP8 decoder in registers instead of the FP4 one, as a single group.

Kernel layout (`PreparedFp8`): within every 16 inputs the values are reordered so that 32-bit word c holds
inputs (2c, 2c+1, 8+2c, 9+2c): the two bf16x2 A-fragment registers lane c needs. Within the word the bits are
not 4 bytes: each value's sign and exponent|mantissa sit where a mask (register 0) or two shifts and masks
(register 1) put them in a bf16 half, sign at bit 15 and exponent|mantissa at bits 4..10, which is e4m3 *
2^-120 exactly (subnormals included) (`expert_gemm.FP8_DECODE`: 6 integer operations a word instead of 10 from
bytes); the decoder then multiplies by 2^(s-7) (`mul.rn.bf16x2`, exact). Scales: the block's UE8M0 byte for
every row, transposed to [K/32, N] (a TMA box per tile; 1/32 of the weight bytes), stored as the bf16 exponent
field of 2^(s-7), s + 120 (`expert_gemm.FP8_SCALE_BIAS`; 0 stays 0), so the decoder builds its multiplier with
one integer multiply. Limits: N % 128 == 0, K % 128 == 0, scale bytes <= MAX_SCALE_BYTE.

Split K: a kernel work item is 128 output rows over all of K, so a linear with few rows (wq_a: N=1280, 10
items) would leave most of the 132 SMs idle. The kernel cuts K into S slices, each a work item of its own
(`KernelConfig.ksplit`, S chosen from the shape at load, see `splits`), which write float32 partial results
(y^T [S * N, tm], the accumulator's orientation) summed here, so the result is rounded to bf16 once, as XLA's
dot rounds it. (The first version stored the slices as S weight groups and wrote bf16 partials: 0.3-0.6% of
the largest output from XLA on the H200, and an engine check that failed at one decode step;
docs/KERNELS_EXPERT_GEMM.md, "FP8 linears".)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsv41.quant import Fp8Weight
from pallas_kernels import expert_gemm as eg

MAX_ROWS = 128  # one token tile (the wgmma N operand); larger batches (prefill) take the XLA path
MAX_SCALE_BYTE = 134  # 2^(s-7) must be a finite bf16
TN, TK = 128, 128
MIN_STEPS = 4  # k-steps a split keeps at least (each work item runs a pipeline of K/S/TK steps)


def splits(n: int, k: int, num_sms: int = 132, groups: int = 1) -> int:
    """K slices S: the fewest (a divisor of K/128 leaving >= MIN_STEPS steps each) giving every SM an item."""
    steps = k // TK
    best = 1
    for s_ in range(1, steps + 1):
        if steps % s_ or steps // s_ < MIN_STEPS:
            continue
        best = s_
        if s_ * groups * (n // TN) >= num_sms:
            break
    return best


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedFp8:
    """An FP8 linear weight [N, K] (or G grouped ones [G, N, K], each group with its own input rows, as wo_a) in
    the kernel layout: `weight` uint8 [G, N, K] (e4m3 bytes, reordered per 16 inputs; G = 1 for a plain
    linear), `scale_t` uint8 [G, K/32, N] (UE8M0 per row and 32 inputs, plus `expert_gemm.FP8_SCALE_BIAS`).
    Static: `splits`, the K slices the kernel runs as separate work items; `interpret`, run the kernel in the
    Mosaic GPU interpreter (CPU tests).
    `dequantize` gives the dense weight ([N, K] or [G, N, K]), so a path without the kernel still works."""

    weight: jax.Array
    scale_t: jax.Array
    splits: int = dataclasses.field(default=1, metadata={"static": True})
    interpret: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def groups(self) -> int:
        return self.weight.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape[1:] if self.groups == 1 else self.weight.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return unprepare_fp8_linear(self).dequantize(dtype)


def supported(w) -> bool:
    """Whether `prepare_fp8_linear` takes this weight (an Fp8Weight [N, K] or [G, N, K], N and K multiples of
    128)."""
    return (isinstance(w, Fp8Weight) and w.weight.ndim in (2, 3) and w.weight.shape[-2] % TN == 0
            and w.weight.shape[-1] % TK == 0)


def _perm_to_kernel(b: jax.Array) -> jax.Array:
    *lead, k = b.shape
    c = b.reshape(*lead, k // 16, 2, 4, 2)  # natural index 8u + 2c + v -> axes (u, c, v)
    return jnp.moveaxis(c, -3, -2).reshape(*lead, k)  # (c, u, v): byte 4c + 2u + v


def prepare_fp8_linear(w: Fp8Weight, interpret: bool = False, check: bool = True,
                       num_splits: int | None = None) -> PreparedFp8:
    """Fp8Weight [N, K] or [G, N, K] -> PreparedFp8 (once, at load). num_splits: K slices (default `splits`)."""
    if not supported(w):
        raise ValueError(f"the FP8 linear kernel needs an Fp8Weight [N, K] or [G, N, K] with N, K multiples of "
                         f"128, got {type(w).__name__} {getattr(w, 'shape', None)}")
    n, k = w.weight.shape[-2:]
    g = w.weight.shape[0] if w.weight.ndim == 3 else 1
    s_ = num_splits or splits(n, k, eg._num_sms(), g)
    if (k // TK) % s_:
        raise ValueError(f"num_splits={s_} must divide K/{TK}={k // TK}")
    weight, scale_t, smax = _kernel_layout(w.weight, w.scale, g)
    if check and not isinstance(smax, jax.core.Tracer) and int(smax) > MAX_SCALE_BYTE:
        raise ValueError(f"UE8M0 scale byte {int(smax)} > {MAX_SCALE_BYTE} is outside the FP8 kernel's range")
    return PreparedFp8(weight, scale_t, s_, interpret)


@functools.partial(jax.jit, static_argnames="g")
def _kernel_layout(weight: jax.Array, scale: jax.Array, g: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One program a weight shape (the bytes' permutation and bit layout, the scales' layout, their largest byte):
    a start-up's preparation compiles a few programs, not a dozen per shape."""
    n, k = weight.shape[-2:]
    raw = jax.lax.bitcast_convert_type(weight, jnp.uint8).reshape(g, n, k)
    rows = jnp.repeat(scale.reshape(g, -1, k // 32), 32, axis=1)[:, :n]  # the block's byte for every row
    scale_t = jnp.swapaxes(eg.kernel_scale_bytes(rows, eg.FP8_SCALE_BIAS), 1, 2)
    return eg.fp8_bytes_to_kernel_bits(_perm_to_kernel(raw)), scale_t, jnp.max(scale)


def unprepare_fp8_linear(p: PreparedFp8) -> Fp8Weight:
    raw = eg._perm8_from_kernel(eg.fp8_kernel_bits_to_bytes(p.weight))
    s_rows = eg.ue8m0_from_kernel(p.scale_t, eg.FP8_SCALE_BIAS)
    rows = jnp.swapaxes(s_rows, 1, 2)[:, ::32]  # [G, N/32, K/32]: a block's rows share its byte
    w = Fp8Weight(jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn), rows)
    return Fp8Weight(w.weight[0], w.scale[0]) if p.groups == 1 else w


def fp8_linear_reference(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """float32 throughout, HIGHEST precision."""
    return jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w.dequantize(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def _config(tm: int, k_iters: int, ksplit: int) -> eg.KernelConfig:
    """Pipeline depth that fits shared memory (x tile, weight tile, scales a stage; the output tiles once: bf16
    [tm, 64], or float32 [64, tm] partials when K is split), preferring one that divides an item's steps so an
    SM's items chain. Up to 8 rows the multiply is warp-level mma.sync (`KernelConfig.warp_mma`): on the H200
    attn.wo_b / engram.wkv took 19.7 / 49.3 us at one row against 20.7 / 51.5 with wgmma,
    attn.wq_b 16.2 either way."""
    stage = tm * TK * 2 + TN * TK + TK // 32 * TN
    out = 2 * tm * 64 * (4 if ksplit > 1 else 2)
    fits = [st for st in (4, 5, 3, 2) if st * stage + out <= 200 * 1024]
    stages = next((st for st in fits if k_iters % st == 0), fits[0])
    return eg.KernelConfig(tm=tm, tk=TK, num_wgs=2, stages=stages, chain=True, ksplit=ksplit,
                           warp_mma=4 if tm == 8 else 0)


def fp8_grouped_linear(x: jax.Array, w: PreparedFp8, config: eg.KernelConfig | None = None) -> jax.Array:
    """x bf16 [G, M, K] (M <= MAX_ROWS), w [G, N, K] -> bf16 [G, M, N]: group g's rows times group g's weight,
    through the kernel (w.interpret: the interpreter). Each group is one tile of the grouped GEMM."""
    g, m, k = x.shape
    n, kw = w.weight.shape[1:]
    if g != w.groups:
        raise ValueError(f"x has {g} groups, weight has {w.groups}")
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows > MAX_ROWS={MAX_ROWS}: use the XLA path (dequantize + dot) for prefill")
    if kw != k:
        raise ValueError(f"x has K={k}, weight has K={kw}")
    tm = max(8, -(-m // 8) * 8)
    xs = jnp.pad(x.astype(jnp.bfloat16), ((0, 0), (0, tm - m), (0, 0))).reshape(g * tm, k)
    cfg = config or _config(tm, k // TK // w.splits, w.splits)
    tiles = jnp.arange(g, dtype=jnp.int32)  # tile t: group t's rows, from row t * tm
    y = eg.run_kernel(eg.pack_schedule(tiles, tiles * tm), xs, w.weight, w.scale_t, e=g, t_max=g, cfg=cfg,
                      interpret=w.interpret, fmt="fp8")
    return y.reshape(g, tm, n)[:, :m]


def fp8_linear(x: jax.Array, w: PreparedFp8, config: eg.KernelConfig | None = None) -> jax.Array:
    """x bf16 [M, K] (M <= MAX_ROWS) -> bf16 [M, N] through the kernel (w.interpret: the interpreter)."""
    if w.groups != 1:
        raise ValueError(f"a grouped weight ({w.groups} groups) takes fp8_grouped_linear")
    return fp8_grouped_linear(x[None], w, config)[0]
