"""Grouped GEMM with FP4 (e2m1 + UE8M0/32) expert weights: y = x @ W_e^T for tokens sorted by expert.

x: bf16 [M, K] (rows sorted by expert, `group_sizes` int32 [E], rows past sum(group_sizes) give 0, as in
`jax.lax.ragged_dot`); W: `Fp4Weight` [E, N, K] (uint8 [E, N, K/2] packed e2m1, element 2k in the low
nibble, bit 3 = sign; uint8 [E, N, K/32] UE8M0 scales); y: bf16 [M, N], float32 accumulation.

Backends (`grouped_fp4_matmul(..., backend=)`):
- 'xla': dequantize every expert to bf16, then `jax.lax.ragged_dot` (what dsv41/moe.py does).
- 'pallas': the Mosaic GPU kernel below (Hopper, wgmma). Needs the weight in the kernel layout
  (`prepare_fp4_experts`, once at load time; a plain Fp4Weight is converted on every call, which reads and
  writes all experts' bytes).
- 'interpret': the same kernel in the Mosaic GPU interpreter (CPU tests); the register-level FP4 decode is
  replaced by a jnp model of the same tile.

The kernel ("weights as the wgmma M operand"): for every (64 weight rows, tile of `tm` token rows) it
streams the expert's packed bytes and scales through shared memory (TMA, warp-specialized pipeline),
decodes them in registers straight into the wgmma A-fragment (bf16), and multiplies with the token tile
taken transposed from shared memory as the B operand (N = tm, as small as 8: decode does not pay for 64
padded token rows). The result is y^T per tile; it is stored transposed through shared memory into a
padded output [T_max * tm, N] (one tm-row slot per tile), and rows are gathered back at the end.

Kernel weight layout (`PreparedFp4`): per group of 32 inputs (16 bytes) the values are permuted so that
the 32-bit word c (bytes 4c..4c+3) holds exactly what lane c of a row quad needs for the A-fragment: its
value n is input 8*(n % 4) + 2*c + n // 4, and A register j of the word holds values j (low bf16) and j + 4
(high). Within the word the 32 bits are not 8 nibbles: each value's sign and e2m1 bits sit where one shift
and one mask (two of each for register 3) move them into a bf16x2 (`FP4_DECODE`, `_FP4_BIT_POS`), which is
9-10 integer operations a word instead of 15-16 for nibbles: the decode is what held the kernel below HBM
bandwidth at decode (without it 24.4 / 738 us at 1 / 64 tokens against 33.1 / 949), and with this layout the
kernel took 27.9 / 793 us on the H200. Scales are transposed to
[E, K/32, N] so a (groups x rows) tile is one TMA box, and each holds the bf16 exponent field of the multiplier
the decoder needs, e = s + 126 (0 for s = 0, which UE8M0 decoding flushes to 0), so that the decoder builds the
bf16x2 multiplier with one integer multiply. Decode of one word q (8 values) and its scale byte e, for j in
0..3:
  m     = e * 0x00800080                                       (bf16x2 (2^(s-1), 2^(s-1)))
  out_j = OR over (r, mask) in FP4_DECODE[j] of rotl(q, r) & mask    (bf16x2 = e2m1 * 2^-126: sign at bits
          15 / 31, the e2m1 exponent and mantissa bits at 8..6 / 24..22)
  a_j   = out_j * m                                            (mul.rn.bf16x2)
which is exact; it needs UE8M0 scale bytes <= 128 (|w| <= 12; real checkpoints are far below), which
`prepare_fp4_experts` checks when the scales are concrete.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv41.quant import Fp4Weight, pack_nibbles, ue8m0_decode, unpack_nibbles

Backend = Literal["pallas", "xla", "interpret"]

MAX_SCALE_BYTE = 128  # 2^(s-1) must be a finite bf16
SCALE_BIAS = 126  # kernel-layout scale byte: the bf16 exponent field of 2^(s-1) (e2m1 decodes as e2m1 * 2^-126)
FP8_SCALE_BIAS = 120  # the FP8 decoder's: 2^(s-7) (e4m3 decodes as e4m3 * 2^-120; `fp8_linear`)


def kernel_scale_bytes(s: jax.Array, bias: int) -> jax.Array:
    """UE8M0 bytes s -> the kernel layout's scale bytes s + bias (byte 0 too: `ue8m0_decode` reads it as 2^-127)."""
    return (s.astype(jnp.int32) + bias).astype(jnp.uint8)


def ue8m0_from_kernel(e: jax.Array, bias: int) -> jax.Array:
    return (e.astype(jnp.int32) - bias).astype(jnp.uint8)


# How the decoder builds A register j of a kernel word: the OR of (the word rotated left by r) & mask. Three
# registers need one shift-and-mask each (their bits are stored where the shift puts them: 4 / 10 positions
# below the bf16 places, or at them); no fourth shift of one mask tiles the remaining 8 bits, so register 3
# takes two (left 6, right 2). `_FP4_PTX` is this table written out; its test runs it on prepared words.
FP4_DECODE = (((0, 0x81C081C0),), ((4, 0x81C081C0),), ((10, 0x81C081C0),),
              ((6, 0x80C080C0), (30, 0x01000100)))
_CODE_BIT = {15: 3, 8: 2, 7: 1, 6: 0}  # bit of a bf16 (e2m1 * 2^-126) -> the e2m1 code bit (sign, e1, e0, m) it holds
# FP8 (`fp8_linear`): a word holds 4 e4m3 values, A register j values 2j (low bf16) and 2j + 1 (high). Register 0
# is the word masked, its bits stored in place; the other 16 bits cannot be one shift of that mask (its runs of
# 7 and 1 bits against the remaining runs of 4), so register 1 takes two (left 4, right 4). `_FP8_PTX` writes it.
FP8_DECODE = (((0, 0x87F087F0),), ((4, 0x80F080F0), (28, 0x07000700)))
_CODE_BIT8 = {15: 7, **{t: t - 4 for t in range(4, 11)}}  # bf16 bit (e4m3 * 2^-120) -> e4m3 bit (sign, e3..m0)


def _bit_positions(table, code_bit: dict[int, int], value_of) -> np.ndarray:
    """int [values, code bits] -> the bit of the kernel word that holds it (from a decode table: register j's bit
    t comes from bit t - r of the word; value_of(j, high half) names the value a bf16 half holds)."""
    n_values = 2 * len(table)
    pos = np.full((n_values, 32 // n_values), -1)
    for j, parts in enumerate(table):
        for r, mask in parts:
            for t in range(32):
                if mask >> t & 1:
                    pos[value_of(j, t >= 16), code_bit[t % 16]] = (t - r) % 32
    assert sorted(pos.ravel()) == list(range(32)), pos  # every bit of the word holds exactly one code bit
    return pos


_FP4_BIT_POS = _bit_positions(FP4_DECODE, _CODE_BIT, lambda j, high: j + 4 * high)
_FP8_BIT_POS = _bit_positions(FP8_DECODE, _CODE_BIT8, lambda j, high: 2 * j + high)


def _words(b: jax.Array) -> jax.Array:
    """uint8 [..., 4n] -> uint32 [..., n] (little-endian, as the GPU reads them)."""
    return jax.lax.bitcast_convert_type(b.astype(jnp.uint8).reshape(*b.shape[:-1], -1, 4), jnp.uint32)


def _bytes(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(*w.shape[:-1], -1)


def _bit_moves(src: np.ndarray, dst: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Bits src[i] -> dst[i] of a uint32 as (source mask, left shift) per distinct shift (8 here, not 32)."""
    moves: dict[int, int] = {}
    for a, b in zip(src.ravel().tolist(), dst.ravel().tolist()):
        moves[b - a] = moves.get(b - a, 0) | (1 << a)
    return tuple((mask, shift) for shift, mask in sorted(moves.items()))


_NIBBLE_BITS = np.arange(32).reshape(8, 4)  # value n's code bit k in nibble n
_TO_KERNEL_BITS = _bit_moves(_NIBBLE_BITS, _FP4_BIT_POS)
_FROM_KERNEL_BITS = _bit_moves(_FP4_BIT_POS, _NIBBLE_BITS)
_BYTE_BITS = np.arange(32).reshape(4, 8)  # value i's bit k in byte i
_TO_KERNEL_BITS8 = _bit_moves(_BYTE_BITS, _FP8_BIT_POS)
_FROM_KERNEL_BITS8 = _bit_moves(_FP8_BIT_POS, _BYTE_BITS)


def _move_bits(b: jax.Array, moves: tuple[tuple[int, int], ...]) -> jax.Array:
    w = _words(b)
    out = jnp.zeros_like(w)
    for mask, shift in moves:
        part = w & jnp.uint32(mask)
        out |= (part << shift) if shift >= 0 else (part >> -shift)
    return _bytes(out)


def _nibbles_to_kernel_bits(b: jax.Array) -> jax.Array:
    """uint8 [..., K/2] with value n of each word in nibble n -> the kernel words' bit layout (`_FP4_BIT_POS`)."""
    return _move_bits(b, _TO_KERNEL_BITS)


def _kernel_bits_to_nibbles(b: jax.Array) -> jax.Array:
    return _move_bits(b, _FROM_KERNEL_BITS)


def fp8_bytes_to_kernel_bits(b: jax.Array) -> jax.Array:
    """uint8 [..., K] e4m3 bytes, value i of each word in byte i -> the FP8 kernel words' bit layout
    (`_FP8_BIT_POS`)."""
    return _move_bits(b, _TO_KERNEL_BITS8)


def fp8_kernel_bits_to_bytes(b: jax.Array) -> jax.Array:
    return _move_bits(b, _FROM_KERNEL_BITS8)


# ---------------------------------------------------------------------------------------------------
# reference and XLA paths


def expert_gemm_reference(x: jax.Array, w: Fp4Weight, group_sizes: jax.Array) -> jax.Array:
    """float32 throughout: y[r] = x[r] @ dequant(W[e_r])^T, rows past sum(group_sizes) are 0.

    Weights dequantized to float32, products and sums in float32 at HIGHEST precision (ragged_dot's
    grouped semantics; tests check it against a float64 per-row loop)."""
    wd = jnp.swapaxes(w.dequantize(jnp.float32), 1, 2)  # [E, K, N]
    return jax.lax.ragged_dot(x.astype(jnp.float32), wd, group_sizes.astype(jnp.int32),
                              precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def grouped_fp4_matmul_xla(x: jax.Array, w: Fp4Weight, group_sizes: jax.Array) -> jax.Array:
    wd = jnp.swapaxes(w.dequantize(jnp.bfloat16), 1, 2)  # [E, K, N]
    y = jax.lax.ragged_dot(x.astype(jnp.bfloat16), wd, group_sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16)


# ---------------------------------------------------------------------------------------------------
# kernel weight layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedFp4:
    """Routed-expert FP4 weight in the kernel layout: `weight` uint8 [E, N, K/2] (values permuted within
    each 32-input group and their bits placed for the decoder), `scale_t` uint8 [E, K/32, N] (UE8M0 bytes +
    SCALE_BIAS, transposed); see the module doc.
    `interpret` (static): the model runs the kernel in the Mosaic GPU interpreter (CPU tests)."""

    weight: jax.Array
    scale_t: jax.Array
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 2)


def _perm_to_kernel(codes: jax.Array) -> jax.Array:
    """codes [..., K] natural order -> kernel nibble order (per 32: word c, nibble n <- 8(n%4)+2c+n//4)."""
    *lead, k = codes.shape
    c = codes.reshape(*lead, k // 32, 4, 4, 2)  # natural index 8j + 2c + v -> axes (j, c, v)
    c = jnp.moveaxis(c, -3, -1)  # (c, v, j): index c*8 + v*4 + j = c*8 + n
    return c.reshape(*lead, k)


def _perm_from_kernel(codes: jax.Array) -> jax.Array:
    *lead, k = codes.shape
    c = codes.reshape(*lead, k // 32, 4, 2, 4)  # (c, v, j)
    c = jnp.moveaxis(c, -1, -3)  # (j, c, v)
    return c.reshape(*lead, k)


def prepare_fp4_experts(w: Fp4Weight, check: bool = True, interpret: bool = False) -> PreparedFp4:
    """Fp4Weight [E, N, K] -> PreparedFp4 (do this once, when the weights are loaded)."""
    if isinstance(w, PreparedFp4):
        return w
    k = w.weight.shape[-1] * 2
    if k % 32:
        raise ValueError(f"in-features {k} must be a multiple of 32")
    weight, scale_t, smax = _kernel_layout(w.weight, w.scale)
    if check and not isinstance(smax, jax.core.Tracer) and int(smax) > MAX_SCALE_BYTE:
        raise ValueError(f"UE8M0 scale byte {int(smax)} > {MAX_SCALE_BYTE}: |w| > 12 is outside the kernel's range")
    return PreparedFp4(weight, scale_t, interpret)


@jax.jit  # one fused pass over the experts' bytes at load time, not a dozen full-size temporaries or programs
def _kernel_layout(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    weight = _nibbles_to_kernel_bits(pack_nibbles(_perm_to_kernel(unpack_nibbles(packed))))
    return weight, jnp.swapaxes(kernel_scale_bytes(scale, SCALE_BIAS), -1, -2), jnp.max(scale)


def concat_out_features(*ws: PreparedFp4, blocks: int = 1) -> PreparedFp4:
    """Prepared weights [E, N_i, K] -> one [E, sum N_i, K] (e.g. w1 and w3: one GEMM call reads each token's x
    once and has twice the work items to spread over the SMs). Each output column is computed exactly as in
    its own call: the kernel's result does not depend on how N is blocked. blocks: N in that many equal blocks,
    block b = block b of every weight in turn (blocks = the tensor ranks that split N: each rank's block is its
    slices of w1 then w3)."""
    if len({(w.weight.shape[0], w.weight.shape[2], w.interpret) for w in ws}) != 1:
        raise ValueError("weights to concatenate need the same experts, in-features and interpret flag")
    if any(w.weight.shape[1] % blocks for w in ws):
        raise ValueError(f"out-features {[w.weight.shape[1] for w in ws]} do not split into {blocks} blocks")

    def cat(arrays, axis):  # each [..., N_i (axis), ...] -> [..., blocks, N_i / blocks, ...], joined per block
        split = [a.reshape(*a.shape[:axis], blocks, -1, *a.shape[axis + 1:]) for a in arrays]
        out = jnp.concatenate(split, axis=axis + 1)
        return out.reshape(*out.shape[:axis], -1, *out.shape[axis + 2:])

    return PreparedFp4(cat([w.weight for w in ws], 1), cat([w.scale_t for w in ws], 2), ws[0].interpret)


def unprepare_fp4_experts(p: PreparedFp4) -> Fp4Weight:
    return Fp4Weight(pack_nibbles(_perm_from_kernel(unpack_nibbles(_kernel_bits_to_nibbles(p.weight)))),
                     jnp.swapaxes(ue8m0_from_kernel(p.scale_t, SCALE_BIAS), -1, -2))


# ---------------------------------------------------------------------------------------------------
# tile schedule


def max_tiles(m: int, e: int, tm: int) -> int:
    """Upper bound on the tiles of `tile_schedule`: sum over experts of ceil(n_e / tm) = E' + sum floor((n_e - 1)
    / tm) <= E' + floor((m - E') / tm) <= cdiv(m, tm) + E' - 1, E' <= min(e, m) the experts with rows."""
    return pl_cdiv(m, tm) + max(min(e, m) - 1, 0)


def padded_rows(m: int, e: int) -> int:
    """Rows of x in the kernel's row layout (`tile_schedule`): every expert's rows from a multiple of 8."""
    return pl_cdiv(m, 8) * 8 + 8 * min(e, m)


def pl_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TileSchedule(NamedTuple):
    """Where the kernel's tiles and rows sit (`tile_schedule`); shapes fix t_max and m."""

    tile_expert: jax.Array  # int32 [t_max]: each tile's expert, -1 past the last live tile
    tile_row: jax.Array  # int32 [t_max]: each tile's first row in the padded row layout (a multiple of 8)
    src: jax.Array  # int32 [padded_rows(m, E)]: the sorted row each padded row holds; m for padding
    pos: jax.Array  # int32 [m]: each sorted row's row in the kernel's output [t_max * tm] (0 if not valid)
    valid: jax.Array  # bool [m]: the sorted row is inside some group

    @property
    def t_max(self) -> int:
        return self.tile_expert.shape[0]


def tile_schedule(group_sizes: jax.Array, m: int, tm: int, t_max: int) -> TileSchedule:
    """Tiles = runs of up to tm rows of one expert, cut from the expert's first row, experts in order.

    Each tile streams its expert's weights once for up to tm of its rows, so an expert is read ceil(n_e / tm)
    times: the fewest for tiles of tm rows. (Tiles of aligned blocks of the sorted rows, the first schedule, read
    an expert once per block its rows touch: for random top-6 routing 261 tiles instead of 245 at 64 tokens of
    Flash's 384 experts, 104 instead of 74 with the bench preset's 64, 475 instead of 384 at a 2048-token prefill
    chunk.) The kernel's TMA loads x in tiles of 8 rows, so a tile must start on a multiple of 8: it reads x in a
    padded row layout [padded_rows(m, E), K] where each expert's rows start on a multiple of 8. A tile's last rows
    may be padding, the next expert's rows or past the end (TMA reads zeros there): computed, never gathered.

    The kernel's output has the tile layout [t_max * tm, N] (tile t's rows at t * tm, `pos`): a caller that
    feeds it to a second GEMM with the same schedule (w1/w3 -> w2: `dsv41.moe`) regathers it into the padded row
    layout by `pos[src]` and calls `matmul_padded` again."""
    gs = group_sizes.astype(jnp.int32)
    e = gs.shape[0]
    gp = (gs + 7) // 8 * 8  # an expert's rows in the padded layout
    n = (gs + tm - 1) // tm  # tiles of each expert
    # the three running sums as one (a decode call's schedule is a few small kernels; each costs a launch)
    ends, pends, cum = jnp.cumsum(jnp.stack([gs, gp, n]), axis=1)
    starts, pstarts, base = ends - gs, pends - gp, cum - n
    search = lambda bounds, v: jnp.minimum(  # noqa: E731
        jnp.searchsorted(bounds, v, side="right", method="compare_all").astype(jnp.int32), e - 1)
    t = jnp.arange(t_max, dtype=jnp.int32)
    te = search(cum, t)
    live = t < cum[-1]
    tile_expert = jnp.where(live, te, -1).astype(jnp.int32)
    tile_row = jnp.where(live, pstarts[te] + (t - base[te]) * tm, 0).astype(jnp.int32)
    r = jnp.arange(m, dtype=jnp.int32)
    re, valid = search(ends, r), r < ends[-1]
    off = r - starts[re]
    pos = (base[re] + off // tm) * tm + off % tm
    # each padded row's sorted row by a search over the padded starts (a gather; a scatter of the rows is a
    # kernel of its own)
    p = jnp.arange(padded_rows(m, e), dtype=jnp.int32)
    pe = search(pends, p)
    poff = p - pstarts[pe]
    src = jnp.where((p < pends[-1]) & (poff < gs[pe]), starts[pe] + poff, m).astype(jnp.int32)
    return TileSchedule(tile_expert, tile_row, src, jnp.where(valid, pos, 0), valid)


def live_tile_count(tile_expert: jax.Array) -> jax.Array:
    """int32 [1]: how many tiles of the schedule are live (they come first)."""
    return jnp.sum(tile_expert >= 0, dtype=jnp.int32).reshape(1)


def _sched_pad(t_max: int) -> int:
    return pl_cdiv(t_max, 4) * 4  # the packed schedule's parts on 16-byte boundaries (a bulk copy's unit)


def pack_schedule(tile_expert: jax.Array, tile_row: jax.Array) -> jax.Array:
    """The kernel's schedule as one int32 array [4 + 2 * t_pad] (t_pad = t_max rounded up to 4): the live tile
    count, 3 zeros, each tile's expert (-1 past the live ones), each tile's first row. The kernel copies it into
    shared memory with one bulk copy at its start, and its loop (chained items) reads a tile's expert and row
    there instead of from global memory. On the H200 this moved neither the calls' times nor the ~1045-cycle seam
    between chained items: the seam's wait is not the schedule's global reads."""
    t_max = tile_expert.shape[0]
    pad = _sched_pad(t_max) - t_max
    return jnp.concatenate([live_tile_count(tile_expert), jnp.zeros((3,), jnp.int32),
                            jnp.pad(tile_expert.astype(jnp.int32), (0, pad), constant_values=-1),
                            jnp.pad(tile_row.astype(jnp.int32), (0, pad))])


# ---------------------------------------------------------------------------------------------------
# the Mosaic GPU kernel


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    tm: int = 8  # token rows per tile = wgmma N (multiple of 8, <= 256)
    tk: int = 256  # inputs per pipeline step (multiple of 64)
    num_wgs: int = 2  # compute warpgroups; each owns 64 weight rows, so tn = 64 * num_wgs
    stages: int = 4  # pipeline depth (max_concurrent_steps)
    # Chain the work items of an SM into one TMA stream (the pipeline's START / STEADY / STOP states): the next
    # item's loads start while this one computes, instead of refilling the pipeline for each item. Needs
    # (K / tk / ksplit) % stages == 0; otherwise every item runs its own pipeline.
    chain: bool = False
    # K cut into this many slices, each its own work item writing a float32 partial result (summed outside, one
    # bf16 rounding): at decode a few experts x N blocks are 1-2 uneven waves over the SMs; slices make more,
    # smaller items. Needs (K / tk) % ksplit == 0.
    ksplit: int = 1
    # Decode and multiply each step's tile in two halves of K: the second half's weights are decoded while the
    # tensor cores multiply the first (wgmma is asynchronous; one wait at the end of the step). Without it the
    # decode of a step and its multiply run one after the other within a warpgroup. `default_config` turns it
    # on where it was faster on the H200 (the 64-row tiles; the 8-row ones take `warp_mma`). Needs tk % 128 == 0.
    overlap: bool = False
    # Multiply with warp-level `mma.sync` (m16n8k16, `plgpu.mma`) instead of wgmma, into this many accumulators
    # (0: wgmma). At 8-row tiles a step's wgmma are 16 m64n8k16 instructions a warpgroup, and a step without its
    # decode still took 781 cycles on the H200 (the kernel's on-device trace): wgmma's cost an instruction barely
    # shrinks with N, and its asynchrony (a fence before, a wait after) keeps a step's multiply and the next
    # step's decode apart. `mma.sync` takes the decoded registers as they are (the A-fragment layout is the same),
    # sums in registers carried from step to step, and is ordered by the register scoreboard alone, so the warp
    # schedulers interleave the multiply with the integer decode. x's B fragments are loaded from the stage's tile
    # (`ldmatrix`). A step's tk/16 instructions are dealt round robin over the accumulators, each a dependent chain
    # (with one, the 16 of a 256-input step ran one after another in the SASS). Excludes `overlap` (about wgmma).
    warp_mma: int = 0

    @property
    def tn(self) -> int:
        return 64 * self.num_wgs


def default_config(m: int, n: int, k: int, e: int = 1) -> KernelConfig:
    """The config for m rows over e experts (N = n, K = k).

    Up to 64 rows an expert on average (decode; a prefill chunk over many experts) the weights are the bytes
    that matter: every SM's work items chained into one TMA stream, which needs the stages to divide the K
    steps. Decode (m <= 512) takes tiles of 8 rows and the longest steps whose stages chain them and fit shared
    memory (`_decode_steps`); on the H200 (bench_expert_gemm, 64 tokens, CUPTI) chaining took w2 from
    665 to 612 us and w1/w3 from 1195-1255 to 1115-1221 us. A prefill chunk with few rows an expert takes tiles
    of 64 and 256-input steps: Flash's 384 experts at a 2048-token chunk (32 rows an expert) took 2235 / 1136 us
    (w1/w3 / w2) against 3341 / 1765 with the 128-row tiles (docs/PERFORMANCE.md). Beyond 64
    rows an expert the GEMM is compute-bound: 128-row tiles (8192 tokens over 384 experts: 61% / 58% of the
    matmul rate).

    The 64-row tiles decode and multiply each step in two halves (`overlap`): on the H200 w1/w3 / w2 took 2223 /
    1144 us at a 2048-token chunk against 2283 / 1157; the 128-row tiles at 8192 tokens were slower with it (w1/w3
    5066 against 4938 us). The 8-row decode tiles multiply with mma.sync into 4 accumulators (`warp_mma`): on the
    H200 w1/w3 took 25.6 / 142.7 / 721.4 us at 1 / 8 / 64 tokens against 28.5 / 150.9 / 732.1 with wgmma in two
    halves."""
    tk = 256 if k % 256 == 0 else 128
    steps = k // tk
    stages = 3 if steps % 4 and steps % 3 == 0 else 4
    overlap = tk % 128 == 0
    if m <= 512:
        # No K slices at one token, although its 216 w1/w3 items are 1.64 waves: with 4 to 10 slices the kernel
        # took 27.3-33.8 us against 28.1 without (H200), the partials' stores and the
        # shorter chains costing what the even waves save.
        tk, stages = _decode_steps(m, k, tk, stages)
        return KernelConfig(tm=8, tk=tk, num_wgs=2, stages=stages, chain=True, warp_mma=4)
    if m <= 64 * e:
        return KernelConfig(tm=64, tk=tk, num_wgs=2, stages=stages, chain=True, overlap=overlap)
    return KernelConfig(tm=128, tk=128, num_wgs=2, stages=4)


def _decode_steps(m: int, k: int, tk: int, stages: int) -> tuple[int, int]:
    """(tk, stages) of the 8-row decode tiles: the longest steps (fewer barrier round trips a byte) whose count
    the stages divide, within shared memory (a stage of 768 inputs is 65 KB: 3 fit, of 512 inputs 43 KB: 5).

    On the H200 (bench_expert_gemm, CUPTI, PASS against the reference): w2 (K
    2304) in 3 steps of 768 took 13.8 / 78.0 / 373.4 us at 1 / 8 / 64 tokens against 14.8 / 88.7 / 425.9 in 9
    steps of 256 through 9 stages; w1/w3 (K 5120) in 10 steps of 512 through 5 stages 158.5 / 756.1 us at 8 /
    64 tokens against 162.4 / 805.6 in 20 of 256 through 4, but 28.8 at one token against 28.0: one token's
    rows (6 with top-6) keep the 256-input steps."""
    if k % 768 == 0 and (k // 768) % 3 == 0:
        return 768, 3
    if m > 8 and k % 512 == 0 and (k // 512) % 5 == 0:
        return 512, 5
    # 8-row tiles are small enough for 9 stages: w2 at Flash's K (9 steps) chained through 9 took 498.0 / 16.8
    # us at 64 / 1 tokens against 515.3 / 17.0 with 3; w1/w3's 20 steps were slower with
    # 5 or 10 stages than with 4
    return tk, 9 if k // tk == 9 else stages


def _dequant_tile_jnp(wb: jax.Array, sb: jax.Array) -> jax.Array:
    """Model of the register decode for interpret mode: packed kernel-layout bytes [64, tk/2] and kernel-layout
    scale bytes [tk/32, 64] -> bf16 [64, tk] in natural input order."""
    codes = _perm_from_kernel(unpack_nibbles(_kernel_bits_to_nibbles(wb))).astype(jnp.uint16)
    mag = codes & 7  # e2m1 without a table constant (kernels may not close over arrays); CPU flushes the
    # subnormal e2m1 * 2^-126 form the GPU decoder uses, so build normal bf16 bits for mag >= 2 instead
    big = jax.lax.bitcast_convert_type((mag << 6) + 0x3F00, jnp.bfloat16).astype(jnp.float32)
    v = jnp.where(mag >= 2, big, mag.astype(jnp.float32) * 0.5)
    v = jnp.where((codes & 8) != 0, -v, v)
    s = ue8m0_decode(ue8m0_from_kernel(sb, SCALE_BIAS)).T  # [64, tk/32]
    v = v.reshape(v.shape[0], -1, 32) * s[:, :, None]
    return v.reshape(v.shape[0], -1).astype(jnp.bfloat16)


def _perm8_from_kernel(b: jax.Array) -> jax.Array:
    """FP8 kernel byte order -> natural order, per 16 inputs (see `fp8_linear.prepare_fp8_linear`)."""
    *lead, k = b.shape
    c = b.reshape(*lead, k // 16, 4, 2, 2)  # (word c, unit u, v): natural 8u + 2c + v
    return jnp.moveaxis(c, -3, -2).reshape(*lead, k)  # (u, c, v)


def _dequant_tile8_jnp(wb: jax.Array, sb: jax.Array) -> jax.Array:
    """Model of the FP8 register decode for interpret mode: kernel-layout e4m3 bytes [64, tk] and kernel-layout
    scale bytes (FP8_SCALE_BIAS) [tk/32, 64] -> bf16 [64, tk] in natural input order."""
    raw = _perm8_from_kernel(fp8_kernel_bits_to_bytes(wb.astype(jnp.uint8)))
    q = jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn).astype(jnp.float32)
    sc = ue8m0_decode(ue8m0_from_kernel(sb, FP8_SCALE_BIAS)).T  # [64, tk/32]
    v = q.reshape(q.shape[0], -1, 32) * sc[:, :, None]
    return v.reshape(q.shape[0], -1).astype(jnp.bfloat16)


# One kernel word ($4) and its scale byte ($5, SCALE_BIAS added) -> 4 bf16x2 A-fragment registers: FP4_DECODE
# written out (module doc). e * 0x00800080 = (e << 7) | (e << 23): e <= 254 keeps e << 7 inside its 16-bit
# half, so both halves are the bf16 2^(e-127).
_FP4_PTX = """{
        .reg .b32 a0, a1, a2, a3, t1, t2, t3, t4, m;
        mul.lo.u32 m, $5, 0x00800080;
        and.b32 a0, $4, 0x81C081C0;
        shl.b32 t1, $4, 4;             and.b32 a1, t1, 0x81C081C0;
        shf.l.wrap.b32 t2, $4, $4, 10; and.b32 a2, t2, 0x81C081C0;
        shl.b32 t3, $4, 6;             and.b32 t3, t3, 0x80C080C0;
        shr.b32 t4, $4, 2;             and.b32 t4, t4, 0x01000100;   or.b32 a3, t3, t4;
        mul.rn.bf16x2 $0, a0, m;
        mul.rn.bf16x2 $1, a1, m;
        mul.rn.bf16x2 $2, a2, m;
        mul.rn.bf16x2 $3, a3, m;
        }"""

# FP8: word c holds inputs (2c, 2c+1, 8+2c, 9+2c) of its 16, their bits where FP8_DECODE puts them: each
# value's sign at bit 15 (31) of its bf16 half and exponent|mantissa at bits 4..10 (20..26), which is
# e4m3 * 2^-120 exactly (subnormals too), then * 2^(s-7) (mul.rn.bf16x2, exact), the multiplier built from the
# scale byte ($3, FP8_SCALE_BIAS added) as in the FP4 decoder. 6 integer operations a word (10 with bytes).
_FP8_PTX = """{
        .reg .b32 p0, p1, t0, t1, m;
        mul.lo.u32 m, $3, 0x00800080;
        and.b32 p0, $2, 0x87F087F0;
        shl.b32 t0, $2, 4;           and.b32 t0, t0, 0x80F080F0;
        shr.b32 t1, $2, 4;           and.b32 t1, t1, 0x07000700;   or.b32 p1, t0, t1;
        mul.rn.bf16x2 $0, p0, m;
        mul.rn.bf16x2 $1, p1, m;
        }"""


def _dequant_tile_mgpu(tk: int, w_transforms, fmt: str = "fp4", half: int | None = None, mma_lhs: bool = False):
    """inline_mgpu: kernel-layout bytes (smem, [64, tk/2] FP4 or [64, tk] FP8, tiled+swizzled) and scale bytes
    (smem [tk/32, 64]) -> bf16 [64, tk] in the WGMMA register layout, ready to be wgmma's A operand. half 0 / 1:
    only the first / second tk/2 inputs, bf16 [64, tk/2] (`KernelConfig.overlap`). mma_lhs: the same registers as
    `plgpu.mma`'s A operand (`Layout.MMA_LHS`: each thread holds the same elements, grouped by k16 block)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    fp8 = fmt == "fp8"
    tkp = tk if fp8 else tk // 2
    swizzle = w_transforms[1].swizzle

    tk_out = tk if half is None else tk // 2

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(w_transforms), plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct(
            (64, tk_out), jnp.bfloat16,
            layout=plgpu.Layout.MMA_LHS(jnp.bfloat16) if mma_lhs else plgpu.Layout.WGMMA),
    )
    def dequant(ctx, w_ref, s_ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        c32 = lambda v: arith.constant(i32, v)
        ci = lambda v: arith.constant(index, v)
        words = mgpu.FragmentedArray.load_tiled(
            w_ref, swizzle=swizzle, is_signed=False, layout=fa.WGMMA_LAYOUT_8BIT)
        assert words.shape == (64, tkp)
        tid = mu.thread_idx()  # i32
        lane = arith.remui(tid, c32(32))
        warp = arith.divui(arith.remui(tid, c32(128)), c32(32))
        row0 = arith.addi(arith.muli(warp, c32(16)), arith.divui(lane, c32(4)))
        out_shape = fa.WGMMA_LAYOUT.registers_shape((64, tk_out))
        regs = np.empty(out_shape, dtype=object)
        n_out = 2 if fp8 else 4  # A-fragment registers one 32-bit word of weights makes
        n_groups = words.registers.shape[1]  # 16-byte groups of a row
        g_lo, g_hi = (0, n_groups) if half is None else (half * n_groups // 2, (half + 1) * n_groups // 2)
        struct_ty = llvm.StructType.get_literal([i32] * n_out)
        ptx, constraints = (_FP8_PTX, "=r,=r,r,r") if fp8 else (_FP4_PTX, "=r,=r,=r,=r,r,r")
        scales = {}  # (scale group, row half) -> its byte, loaded once
        for idx, reg in np.ndenumerate(words.registers):
            g, rh = idx[1], idx[4]
            assert idx[0] == 0 and all(v == 0 for i, v in enumerate(idx) if i not in (1, 4))
            if not g_lo <= g < g_hi:
                continue
            key = (g // 2 if fp8 else g, rh)  # FP4: one 16-byte group is 32 inputs; FP8: 16, so two share one
            if key not in scales:
                row = arith.index_cast(index, arith.addi(row0, c32(8 * rh)))
                scales[key] = arith.extui(i32, memref.load(s_ref, [ci(key[0]), row]))
            q = mu.bitcast(reg, i32)
            res = llvm.inline_asm(struct_ty, [q, scales[key]], ptx, constraints)
            for j in range(n_out):
                o = llvm.extractvalue(i32, res, [j])
                ridx = list(idx)
                ridx[1] = n_out * (g - g_lo) + j
                regs[tuple(ridx)] = mu.bitcast(o, bf16x2)
        if mma_lhs:
            # WGMMA_LAYOUT's registers [1, tk/8 (8-input column), 1, 1, 2 (row +8), 1...] regrouped as MMA_LHS's
            # [1, tk/16 (k16 block), 1, 2 (its 8-input half), 2 (row +8), 1...]: mma.sync's a0..a3 order
            lhs = mgpu.MMALayouts(ir.BF16Type.get(), m_warps=4).lhs
            lregs = np.empty(lhs.registers_shape((64, tk_out)), dtype=object)
            for idx, r in np.ndenumerate(regs):
                lidx = list(idx)
                lidx[1], lidx[3] = idx[1] // 2, idx[1] % 2
                lregs[tuple(lidx)] = r
            return mgpu.FragmentedArray(_registers=lregs, _layout=lhs, _is_signed=None)
        return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return dequant


# `KernelConfig.warp_mma` takes token tiles up to this many rows (the GPU tests run 8 and 16)
WARP_MMA_MAX_TM = 16


def _mma_chains_mgpu(tk: int, tm: int, chains: int):
    """inline_mgpu: (`chains` sums float32 [64, tm], A bf16 [64, tk] (MMA_LHS), B bf16 [tk, tm] (MMA_RHS)) -> the
    sums with A @ B added, k16 block j of it into sum j % chains (`KernelConfig.warp_mma`)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    acc_layout = plgpu.Layout.MMA_ACC(jnp.bfloat16)
    acc_type = plgpu.ShapeDtypeStruct((64, tm), jnp.float32, layout=acc_layout)

    @plgpu.inline_mgpu(
        arg_types=((acc_layout,) * chains, plgpu.Layout.MMA_LHS(jnp.bfloat16), plgpu.Layout.MMA_RHS(jnp.bfloat16)),
        return_type=(acc_type,) * chains,
    )
    def mma_chains(ctx, sums, a, b):
        del ctx
        sums = list(sums)
        for j in range(tk // 16):
            ks = slice(16 * j, 16 * (j + 1))
            sums[j % chains] = mgpu.mma(sums[j % chains], a[:, ks], b[ks, :])
        return tuple(sums)

    return mma_chains


@functools.lru_cache(maxsize=None)
def _build_kernel(m: int, k: int, n: int, e: int, t_max: int, cfg: KernelConfig, interpret: bool,
                  fmt: str = "fp4", out_dtype=jnp.bfloat16):
    """fmt 'fp4': packed e2m1 [E, N, K/2] + UE8M0 per 32 inputs (`PreparedFp4`); 'fp8': e4m3 [E, N, K] +
    UE8M0 per 32 inputs, row-expanded (`fp8_linear.PreparedFp8`). Scales transposed [E, K/32, N] either way.
    out_dtype: bf16 -> y [t_max * tm, N]; float32 (K-slice partials, summed outside) -> y^T
    [cfg.ksplit * N, t_max * tm] (slice-major), the accumulator's own orientation (its transposed store into a
    swizzled float32 tile does not lower: "Failed to infer a possible set of layouts")."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tm, tk, nwg, tn = cfg.tm, cfg.tk, cfg.num_wgs, cfg.tn
    tkp, gs = (tk if fmt == "fp8" else tk // 2), tk // 32
    if tm % 8 or tm > 256:
        raise ValueError(f"tm={tm} must be a multiple of 8 and <= 256")
    if not 1 <= nwg <= 3:
        # 4 compute warpgroups hung the H200 twice (tk 128 with 8 stages, tk 256 with 4: docs/KERNELS_EXPERT_GEMM.md)
        # and a hung kernel ignores signals: refuse it rather than lock up the GPU
        raise ValueError(f"num_wgs={nwg}: the kernel runs 1 to 3 compute warpgroups")
    if tk % 64:
        raise ValueError(f"tk={tk} must be a multiple of 64")
    if tkp > 128 and tkp % 128:
        # the weight tile's rows are tiled and swizzled in 128-byte units (a trace-time assertion otherwise)
        raise ValueError(f"tk={tk}: a step's {tkp} weight bytes a row must be a multiple of 128 past 128")
    if cfg.overlap and tk % 128:
        raise ValueError(f"overlap decodes halves of tk={tk}: tk must be a multiple of 128")
    if cfg.warp_mma and cfg.overlap:
        raise ValueError("warp_mma multiplies with synchronous mma.sync from registers: overlap (about wgmma) does "
                         "not apply; turn it off")
    if cfg.warp_mma and tm > WARP_MMA_MAX_TM:
        # every warp holds a step's whole x tile as B fragments (tk * tm / 64 registers a thread)
        raise ValueError(f"warp_mma is for tiles of 8 or 16 rows (tm={tm}): take wgmma (warp_mma=0) for larger ones")
    if k % tk or n % tn:
        raise ValueError(f"K={k} must be a multiple of tk={tk} and N={n} of tn={tn}")
    ks = cfg.ksplit
    if (k // tk) % ks:
        raise ValueError(f"ksplit={ks} must divide K/tk={k // tk}")
    out_dtype = jnp.dtype(out_dtype)
    if ks > 1 and out_dtype != jnp.float32:
        raise ValueError("ksplit > 1 writes float32 partial results: out_dtype must be float32")
    k_iters = k // tk // ks  # pipeline steps of one work item
    kp = k // ks  # inputs of one K slice
    n_blocks = n // tn
    chain = cfg.chain and k_iters % cfg.stages == 0
    x_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    w_swz = min(128, tkp)
    w_transforms = (plgpu.TilingTransform((8, w_swz)), plgpu.SwizzleTransform(w_swz))
    out_t = out_dtype == jnp.float32
    if out_t:  # [64 weight rows, tm tokens] tiles; the swizzle spans one row of tm float32
        o_swz = next(b for b in (128, 64, 32) if tm * 4 % b == 0)
        o_shape, o_transforms = (nwg, 64, tm), (plgpu.TilingTransform((8, o_swz // 4)), plgpu.SwizzleTransform(o_swz))
    else:
        o_shape, o_transforms = (nwg, tm, 64), (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    halves = (0, 1) if cfg.overlap else (None,)  # the K parts of a step decoded and multiplied in turn
    dequant = None if interpret else {h: _dequant_tile_mgpu(tk, w_transforms, fmt, h, mma_lhs=cfg.warp_mma)
                                      for h in halves}
    dequant_model = _dequant_tile8_jnp if fmt == "fp8" else _dequant_tile_jnp
    mma_chains = _mma_chains_mgpu(tk, tm, cfg.warp_mma) if cfg.warp_mma and not interpret else None
    # The interpreter's wgmma takes A only from shared memory.
    a_smem_mode = interpret and not cfg.warp_mma
    t_pad = _sched_pad(t_max)
    scratch = {"o_smem": plgpu.SMEM(o_shape, out_dtype, transforms=o_transforms),
               "sched_smem": plgpu.SMEM((4 + 2 * t_pad,), jnp.int32), "sched_bar": plgpu.Barrier(num_arrivals=1)}
    if a_smem_mode:
        scratch["a_smem"] = plgpu.SMEM((nwg, 64, tk), jnp.bfloat16, transforms=x_transforms)

    def multiply_step(wg, x_smem, w_smem, s_smem, acc, a_smem):
        """One pipeline step of warpgroup wg: decode its 64 weight rows of the stage and multiply them into the ref
        acc, then wait for the tensor cores. With warp_mma acc is a tuple of
        warp_mma partial sums (values, float32 [64, tm] each, together y^T so far) and the new ones are returned."""
        w_wg = w_smem.at[pl.ds(wg * 64, 64)]
        s_wg = s_smem.at[:, pl.ds(wg * 64, 64)]
        a_full = dequant_model(w_wg[...], s_wg[...]) if interpret else None
        if cfg.warp_mma:  # acc: a partial sum a chain, each float32 [64, tm]
            if interpret:  # the interpreter has no mma.sync: the same sum as a dot
                return (acc[0] + jnp.dot(a_full, x_smem[...].T, preferred_element_type=jnp.float32), *acc[1:])
            with jax.named_scope("decode"):
                a = dequant[None](w_wg, s_wg)
            b = plgpu.load(x_smem.transpose((1, 0)), layout=plgpu.Layout.MMA_RHS(jnp.bfloat16))
            return mma_chains(acc, a, b)
        for h in halves:
            lo, width = (0, tk) if h is None else (h * (tk // 2), tk // 2)
            ks = pl.ds(lo, width)
            with jax.named_scope("decode"):
                a = a_full[:, lo:lo + width] if interpret else dequant[h](w_wg, s_wg)
            if a_smem_mode:
                a_smem.at[wg, :, ks][...] = a
                plgpu.commit_smem()
                a = a_smem.at[wg, :, ks]
            # no wait between the halves: the second half decodes while the first multiplies
            plgpu.wgmma(acc, a, x_smem.at[:, ks].transpose((1, 0)))
        with jax.named_scope("wait"):
            plgpu.wgmma_wait(0)

    def kernel(sched_gmem, *refs, sched_smem, sched_bar, **scratch_refs):
        with jax.named_scope("cta"):  # named regions, for a profiler's trace of the kernel

            @pl.when(jax.lax.axis_index("wg") == 0)
            def _copy():
                # the whole array: a bulk copy (a tiled TMA box takes at most 256 entries)
                plgpu.copy_gmem_to_smem(sched_gmem, sched_smem, sched_bar,
                                        oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

            plgpu.barrier_wait(sched_bar)
            sched = _Sched(sched_smem, t_pad)
            kernel_body(sched, *refs, **scratch_refs)

    num_sms = _kernel_sms(interpret)

    def acc_zeros():
        """The first running sum, float32 [64, tm]; with warp_mma, one a chain in mma.sync's layout."""
        z = jnp.zeros((64, tm), jnp.float32)
        if not cfg.warp_mma:
            return z
        if not interpret:
            z = plgpu.layout_cast(z, plgpu.Layout.MMA_ACC(jnp.bfloat16))
        return (z,) * cfg.warp_mma

    def acc_sum(sums):  # warp_mma's partial sums, a chain each -> their sum
        return functools.reduce(jnp.add, sums)

    def kernel_body(sched, x_gmem, w_gmem, s_gmem, o_gmem, o_smem, a_smem=None):
        def get_pipeline(body, compute_context, state=None):
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=x_transforms,
                                    memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((tn, tkp), lambda kk: (0, kk), transforms=w_transforms,
                                    memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((gs, tn), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
                ],
                wg_axis="wg",
                num_compute_wgs=nwg,
                max_concurrent_steps=cfg.stages,
                compute_context=compute_context,
                pipeline_state=state,
            )

        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            allocs=get_pipeline(ignore, ignore).get_allocations(
                x_gmem.at[pl.ds(0, tm), pl.ds(0, kp)], w_gmem.at[0, pl.ds(0, tn), pl.ds(0, kp * tkp // tk)],
                s_gmem.at[0, pl.ds(0, kp // 32), pl.ds(0, tn)]),
            collective_axes="wg",
        )
        def _scope(allocs):
            wg = jax.lax.axis_index("wg")

            # Live tiles come first in the schedule: loop over exactly the live (tile, N-block, K-slice) items.
            @plgpu.nd_loop((sched.live() * n_blocks * ks,), collective_axes="sm")
            def _loop(info):
                (lin,) = info.index
                t = lin // (n_blocks * ks)
                nb = lin % (n_blocks * ks) // ks
                sp = lin % ks
                ex = sched.expert(t)
                row0 = pl.multiple_of(sched.row(t), 8)  # tile_schedule: on a multiple of 8 (TMA tiles of 8 rows)

                def store(y):  # y: float32 [64, tm] = y^T of this warpgroup's rows
                    with jax.named_scope("store"):
                        y = y.astype(out_dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        if out_t:
                            o_smem.at[wg][...] = y
                            dst = o_gmem.at[pl.ds(sp * n + nb * tn + wg * 64, 64), pl.ds(t * tm, tm)]
                        else:
                            o_smem.at[wg].transpose((1, 0))[...] = y
                            dst = o_gmem.at[pl.ds(t * tm, tm), pl.ds(nb * tn + wg * 64, 64)]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem.at[wg], dst)

                def compute_context(eval_pipeline):
                    if cfg.warp_mma:  # the sums are values carried from step to step
                        with jax.named_scope("item"):
                            sums = eval_pipeline(acc_zeros())
                        store(acc_sum(sums))
                        return
                    @functools.partial(pl.run_scoped, acc0=plgpu.ACC((64, tm), jnp.float32))
                    def _acc(acc0):
                        with jax.named_scope("item"):
                            eval_pipeline(acc0)
                        store(acc0[...])

                def mma_body(_, x_smem, w_smem, s_smem, acc):
                    with jax.named_scope("step"):
                        out = multiply_step(wg, x_smem, w_smem, s_smem, acc, a_smem)
                    return out if cfg.warp_mma else acc

                refs = (x_gmem.at[pl.ds(row0, tm), pl.ds(sp * kp, kp)],
                        w_gmem.at[ex, pl.ds(nb * tn, tn), pl.ds(sp * (kp * tkp // tk), kp * tkp // tk)],
                        s_gmem.at[ex, pl.ds(sp * (kp // 32), kp // 32), pl.ds(nb * tn, tn)])
                if not chain:
                    get_pipeline(mma_body, compute_context)(*refs, allocations=allocs)
                    return
                # An SM's items form one stream: START, STEADY..., STOP; a lone item runs a plain pipeline.
                first = info.local_index == 0
                last = info.local_index == info.num_local_steps - 1

                @pl.when(first & last)
                def _alone():
                    get_pipeline(mma_body, compute_context)(*refs, allocations=allocs)

                @pl.when(jnp.logical_not(first & last))
                def _chained():
                    ps = plgpu.PipelinePipeline
                    state = jnp.where(first, int(ps.START), jnp.where(last, int(ps.STOP), int(ps.STEADY)))
                    get_pipeline(mma_body, compute_context, state)(*refs, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    # jit-wrapped and cached: the model is unrolled over its layers, and a program lowers a jitted kernel once
    # however many layers call it (lowering the 8-layer bench decode step at batch 64: 8.8 s instead of 38.6 s)
    out_type = jax.ShapeDtypeStruct((ks * n, t_max * tm) if out_t else (t_max * tm, n), out_dtype)
    return jax.jit(plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=nwg + 1,
        thread_name="wg",
        kernel_name="fp8_linear" if fmt == "fp8" else "expert_gemm_fp4",
        compiler_params=plgpu.CompilerParams(),
        scratch_types=scratch,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    ))


class _Sched(NamedTuple):
    """The kernel's view of `pack_schedule`'s array, copied into shared memory."""

    ref: object  # int32 [4 + 2 * t_pad] in shared memory
    t_pad: int

    def live(self):
        return self.ref[0]

    def expert(self, t):
        return self.ref[4 + t]

    def row(self, t):
        return self.ref[4 + self.t_pad + t]


def _kernel_sms(interpret: bool) -> int:
    """The kernel's grid: one CTA an SM; 2 in the interpreter, which simulates every block."""
    return 2 if interpret else _num_sms()


def _num_sms() -> int:
    d = jax.devices()[0]
    return int(getattr(d, "core_count", 132)) if d.platform == "gpu" else 132


def grouped_fp4_matmul_pallas(x: jax.Array, w: Fp4Weight | PreparedFp4, group_sizes: jax.Array,
                              config: KernelConfig | None = None, interpret: bool = False) -> jax.Array:
    pw = prepare_fp4_experts(w, check=False)
    m, k = x.shape
    e, n, k2 = pw.weight.shape
    if k2 * 2 != k:
        raise ValueError(f"x has K={k}, weight has K={k2 * 2}")
    cfg = config or default_config(m, n, k, e)
    sched = tile_schedule(group_sizes, m, cfg.tm, max_tiles(m, e, cfg.tm))
    xp = jnp.take(x, sched.src, axis=0, mode="fill", fill_value=0)  # the padded row layout
    y_tiles = matmul_padded(xp, pw, sched, cfg, interpret)
    return jnp.where(sched.valid[:, None], y_tiles[sched.pos], jnp.zeros((), jnp.bfloat16))


def matmul_padded(xp: jax.Array, w: PreparedFp4, sched: TileSchedule, cfg: KernelConfig,
                  interpret: bool = False) -> jax.Array:
    """The kernel alone: x bf16 in the schedule's padded row layout [padded_rows(m, E), K] -> y bf16 in its tile
    layout [t_max * tm, N] (sorted row r at `sched.pos[r]`; rows of no sorted row are unspecified). For callers
    that keep their rows in these layouts between GEMMs (`dsv41.moe`) instead of gathering each call's rows
    back."""
    return run_kernel(pack_schedule(sched.tile_expert, sched.tile_row), xp, w.weight, w.scale_t,
                      e=w.weight.shape[0], t_max=sched.t_max, cfg=cfg, interpret=interpret)


def run_kernel(sched, x, weight, scale_t, *, e: int, t_max: int, cfg: KernelConfig, interpret: bool,
               fmt: str = "fp4") -> jax.Array:
    """The kernel over a tile schedule (`pack_schedule`; x in its row layout, tile rows on multiples of 8:
    `tile_schedule`) -> bf16 [t_max * tm, N] (rows of dead tiles unwritten). With K slices (cfg.ksplit > 1) the
    kernel writes float32 partials y^T [ksplit * N, t_max * tm], summed here and rounded once (the sum fuses into
    the caller's gather)."""
    m, k = x.shape
    n = weight.shape[1]
    args = (sched, x.astype(jnp.bfloat16), weight, scale_t)
    if cfg.ksplit == 1:
        return _build_kernel(m, k, n, e, t_max, cfg, interpret, fmt)(*args)
    part = _build_kernel(m, k, n, e, t_max, cfg, interpret, fmt, out_dtype=jnp.float32)(*args)
    return part.reshape(cfg.ksplit, n, t_max * cfg.tm).sum(0).T.astype(jnp.bfloat16)


def grouped_fp4_matmul(x: jax.Array, w: Fp4Weight | PreparedFp4, group_sizes: jax.Array,
                       backend: Backend = "pallas", config: KernelConfig | None = None) -> jax.Array:
    """x bf16 [M, K] sorted by expert, W [E, N, K] FP4, group_sizes int32 [E] -> bf16 [M, N]."""
    if backend == "xla":
        if isinstance(w, PreparedFp4):
            w = unprepare_fp4_experts(w)
        return grouped_fp4_matmul_xla(x, w, group_sizes)
    if backend == "pallas":
        return grouped_fp4_matmul_pallas(x, w, group_sizes, config)
    if backend == "interpret":
        return grouped_fp4_matmul_pallas(x, w, group_sizes, config, interpret=True)
    raise ValueError(f"unknown backend {backend!r}")
