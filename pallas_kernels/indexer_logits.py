"""Sparse MQA indexer logits straight from the paged MXFP4 index-key pool (Mosaic GPU), plus the top-k.

For query i = (b, s) and entry n (a compressed position g of row b):

    score[b, s, n] = bf16( sum_h bf16( relu( bf16(q[b,s,h,:] . k[g,:]) ) * w[b,s,h] ) )

with exactly the rounding steps of `dsv41.indexer.scores` (f32 head sum, result returned as f32), -inf where the
entry is not visible to the query (g >= (q_pos+1)//ratio) or does not exist (-1 candidate block, bad page).

Keys are read from the pool: `ik_packed` uint8 [pages, E, ID/2] (e2m1, element 2k in the low nibble) and
`ik_scale` uint8 UE8M0 [pages, E, ID/32] (`quant.mxfp4_decode`; the producer's PTX is its twin in
`codec_ptx`); entry g of row b is at page block_table[b, g // E], offset g % E.
Two entry sources:
  * candidates: the NB blocks of 8 entries chosen by layer 20 (`cand_blocks` [B, NB] or [B, S, NB], ascending,
    -1 = none) -> NB*8 entries per query: cost flat in context length;
  * context: entries 0..G-1 (G static), the encoder indexers and layer 20 itself.

Kernel (one CTA per (key split, row), 2 warpgroups):
  * WG1 (producer): TMA-loads q [S*IH, ID] bf16, the masked head weights and the CTA's physical row ids, then per
    tile of T=64 entries gathers 64 packed bytes + one scale byte per 32 elements with 16-byte `ld.global.nc`
    (4 lanes per entry, every load of the tile in flight at once), dequantizes with `prmt` (e2m1 byte LUT) and an
    exact `mul.rn.bf16x2` by 2^(s-127), and stores bf16 into a 128B-swizzled shared tile (2 stages) plus a 0/-inf
    bias per entry (invalid rows are zero-filled: no NaN from garbage pages).
  * WG0 (consumer): S^T = K Q^T with wgmma (keys are M=64, queries x heads are N = S*IH <= 256, ID = 128 is K),
    releases the stage, then bf16 rounding / relu / weights / f32 head sum / bf16 in registers and stores one f32
    score per entry and query.
Queries x heads share the N dimension; the per-query head sum uses head weights zeroed outside the query's heads
(S multiplies of the [64, S*IH] tile: free for S=1, cheap up to S=8).

Interpret mode (CPU): the Mosaic GPU interpreter cannot run inline PTX, so the wrapper pre-gathers each tile's rows
and the producer dequantizes them with jnp; pipeline, barriers, wgmma and the epilogue are the same code.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from dsv41 import indexer, quant, topk
from pallas_kernels import codec_ptx
from pallas_kernels import indexer_chunk as ic
from pallas_kernels import topk_select
from pallas_kernels.indexer_chunk import query_group

log = logging.getLogger(__name__)

TILE = 64          # entries per tile = wgmma M
NUM_STAGES = 2     # shared-memory stages of dequantized key tiles
SCALE_BLOCK = 32   # MXFP4: one UE8M0 scale per 32 elements
NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """The indexer's selection sizes (ModelConfig names: index_topk, candidate_block_size, candidate_topk_blocks)."""

    index_topk: int = 512
    candidate_block_size: int = 8
    candidate_topk_blocks: int = 2048
    topk_method: str = "auto"  # one of TOPK_METHODS: topk_entries

    @classmethod
    def from_model(cls, cfg) -> IndexerConfig:
        return cls(cfg.index_topk, cfg.candidate_block_size, cfg.candidate_topk_blocks)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """max_ctas: target CTAs in the grid (B * splits); ~4 small CTAs fit one SM (40-100 KB smem each).
    max_tiles_per_cta: bounds the row-id table in shared memory (256 B per tile).
    prefetch: a producer has only one tile's loads in flight (it needs them to dequantize), so the next tile's
    rows are prefetched into L2 first: two tiles of HBM latency overlap per CTA."""

    max_ctas: int = 4 * NUM_SMS
    max_tiles_per_cta: int = 64
    prefetch: bool = True      # L2-prefetch the next tile's rows while this one is gathered/dequantized


# ----------------------------------------------------------------------------------------------------------------
# Entry ids -> physical pool rows (XLA, cheap: 4 bytes per entry)
# ----------------------------------------------------------------------------------------------------------------


def visible_count(q_pos: jax.Array, ratio: int) -> jax.Array:
    """q_pos [B, S] -> number of complete compressed entries per query [B, S]."""
    return (jnp.asarray(q_pos, jnp.int32) + 1) // ratio


def pool_rows(entries: jax.Array, block_table: jax.Array, entries_per_page: int, num_pages: int) -> jax.Array:
    """Entry ids [B, N] (-1 = none) -> flat pool row page*E + offset [B, N], -1 for none / pages out of range."""
    E = entries_per_page
    bt = jnp.asarray(block_table, jnp.int32)
    g = jnp.maximum(entries, 0)
    col = g // E
    page = jnp.take_along_axis(bt, jnp.clip(col, 0, bt.shape[1] - 1), axis=1)
    ok = (entries >= 0) & (col < bt.shape[1]) & (page >= 0) & (page < num_pages)
    return jnp.where(ok, page * E + g % E, -1).astype(jnp.int32)


def candidate_entries(cand_blocks: jax.Array, block_size: int = 8) -> jax.Array:
    """Candidate block ids [..., NB] (-1 = none) -> entry ids [..., NB*block_size] (-1 = none), ascending."""
    c = jnp.asarray(cand_blocks, jnp.int32)
    g = c[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    g = jnp.where(c[..., None] >= 0, g, -1)
    return g.reshape(*c.shape[:-1], c.shape[-1] * block_size)


# ----------------------------------------------------------------------------------------------------------------
# Plain-jnp reference
# ----------------------------------------------------------------------------------------------------------------


def dequant_rows(ik_packed: jax.Array, ik_scale: jax.Array, rows: jax.Array) -> jax.Array:
    """Pool rows [B, N] (-1 = none) -> f32 keys [B, N, ID] (0 for none), as programs._context_index_keys:
    `quant.mxfp4_decode` of the gathered records."""
    P, E, half = ik_packed.shape
    r = jnp.maximum(rows, 0)
    k = quant.mxfp4_decode(ik_packed.reshape(P * E, half)[r], ik_scale.reshape(P * E, -1)[r])
    return jnp.where((rows >= 0)[..., None], k, 0.0)


def scores_from_keys(q: jax.Array, w: jax.Array, k: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """`indexer.raw_scores`: q [B, S, IH, ID], w [B, S, IH], k [B, N, ID] -> f32 [B, S, N]."""
    return indexer.raw_scores(q, w, k, dtype)


def entry_scores_reference(q, w, ik_packed, ik_scale, rows, dtype=jnp.bfloat16):
    """Scores of pool rows [B, N] for every query: f32 [B, S, N], -inf where rows < 0 (plain jnp). dtype: the
    rounding of each step (the kernel's is bf16; float32 matches a float32 model run)."""
    s = scores_from_keys(q, w, dequant_rows(ik_packed, ik_scale, rows), dtype)
    return jnp.where((rows >= 0)[:, None, :], s, -jnp.inf)


# ----------------------------------------------------------------------------------------------------------------
# GPU producer: gather + MXFP4 dequant (inline Mosaic GPU + PTX), 128 threads
# ----------------------------------------------------------------------------------------------------------------

def _mgpu_dequant_fn(d: int):
    """inline_mgpu body: fill one swizzled bf16 [TILE, d] key tile + its 0/-inf bias from pool rows.

    Thread mapping: d/32 lanes per entry, each loads 16 packed bytes (32 elements) + their one scale byte."""
    lanes_per_row = d // 32
    rows_per_pass = 128 // lanes_per_row
    n_iter = TILE // rows_per_pass

    def fn(ctx, src_ref, scale_ref, rows_ref, k_ref, bias_ref):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm
        from jax.experimental.mosaic.gpu import utils as mu

        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        f32 = ir.F32Type.get()

        def ci(v):
            return arith.constant(i32, v)

        def cl(v):
            return arith.constant(i64, v)

        tid = arith.remui(mu.thread_idx(), ci(128))
        src = llvm.ptrtoint(i64, mu.memref_ptr(src_ref))
        scl = llvm.ptrtoint(i64, mu.memref_ptr(scale_ref))
        rows_base = llvm.ptrtoint(i32, mu.memref_ptr(rows_ref))
        k_base = llvm.ptrtoint(i32, mu.memref_ptr(k_ref))
        bias_base = llvm.ptrtoint(i32, mu.memref_ptr(bias_ref))
        zero = ci(0)
        m = arith.remui(tid, ci(lanes_per_row))
        rsub = arith.divui(tid, ci(lanes_per_row))
        is_m0 = arith.cmpi(arith.CmpIPredicate.eq, m, zero)

        def load_row(i):
            r = arith.addi(rsub, ci(rows_per_pass * i))
            rid = mu.inline_ptx("ld.shared.b32 $0, [$1];", arith.addi(rows_base, arith.muli(r, ci(4))),
                                result_types=i32, has_side_effects=True)
            valid = arith.cmpi(arith.CmpIPredicate.sge, rid, zero)
            row = arith.extui(i64, arith.maxsi(rid, zero))
            addr = arith.addi(arith.addi(src, arith.muli(row, cl(d // 2))), arith.extui(i64, arith.muli(m, ci(16))))
            words = mu.inline_ptx(
                "{ .reg .b64 g; cvta.to.global.u64 g, $4; ld.global.nc.v4.b32 {$0, $1, $2, $3}, [g]; }",
                addr, result_types=[i32] * 4, has_side_effects=True)
            saddr = arith.addi(arith.addi(scl, arith.muli(row, cl(d // SCALE_BLOCK))), arith.extui(i64, m))
            sc = mu.inline_ptx(
                "{ .reg .b64 g; .reg .b16 t; cvta.to.global.u64 g, $1; ld.global.nc.u8 t, [g]; cvt.u32.u16 $0, t; }",
                saddr, result_types=i32, has_side_effects=True)
            # Invalid rows are zero-filled (data and scale): no NaN/Inf from garbage pages.
            words = [arith.select(valid, w, zero) for w in words]
            sc = arith.select(valid, sc, zero)
            bias = arith.select(valid, arith.constant(f32, 0.0), arith.constant(f32, float("-inf")))
            mu.inline_ptx("@$2 st.shared.f32 [$0], $1;", arith.addi(bias_base, arith.muli(r, ci(4))), bias, is_m0,
                          has_side_effects=True)
            return r, words, sc

        def store_chunk(r, q, regs):
            # TilingTransform((8, 64)) + SwizzleTransform(128) byte offset of 16-byte chunk q of row r:
            # ((r//8)*(d/64) + q//8)*1024 + (r%8)*128 + ((q%8)^(r%8))*16
            r8 = arith.remui(r, ci(8))
            off = arith.muli(arith.addi(arith.muli(arith.divui(r, ci(8)), ci(d // 64)), arith.divui(q, ci(8))),
                             ci(1024))
            off = arith.addi(off, arith.muli(r8, ci(128)))
            off = arith.addi(off, arith.muli(arith.xori(arith.remui(q, ci(8)), r8), ci(16)))
            mu.inline_ptx("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", arith.addi(k_base, off), *regs,
                          has_side_effects=True)

        # Issue every load of the tile before the first dequant: the gather is latency-bound.
        loaded = [load_row(i) for i in range(n_iter)]
        for r, words, sc in loaded:
            s2 = codec_ptx.ue8m0_bf16x2(sc)
            for j, w in enumerate(words):
                regs = mu.inline_ptx(codec_ptx.FP4_WORD_PTX, w, s2, result_types=[i32] * 4)
                store_chunk(r, arith.addi(arith.muli(m, ci(4)), ci(j)), regs)
        return ()

    return fn


def _mgpu_prefetch_fn(d: int):
    """inline_mgpu body: prefetch.global.L2 one tile's rows (thread r < 64: packed row r; 64 <= r: its scales)."""

    def fn(ctx, src_ref, scale_ref, rows_ref):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm
        from jax.experimental.mosaic.gpu import utils as mu

        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)

        def ci(v):
            return arith.constant(i32, v)

        tid = arith.remui(mu.thread_idx(), ci(128))
        r = arith.remui(tid, ci(TILE))
        is_scale = arith.cmpi(arith.CmpIPredicate.uge, tid, ci(TILE))
        rows_base = llvm.ptrtoint(i32, mu.memref_ptr(rows_ref))
        rid = mu.inline_ptx("ld.shared.b32 $0, [$1];", arith.addi(rows_base, arith.muli(r, ci(4))),
                            result_types=i32, has_side_effects=True)
        ok = arith.cmpi(arith.CmpIPredicate.sge, rid, ci(0))
        row = arith.extui(i64, arith.maxsi(rid, ci(0)))
        src = llvm.ptrtoint(i64, mu.memref_ptr(src_ref))
        scl = llvm.ptrtoint(i64, mu.memref_ptr(scale_ref))
        data_addr = arith.addi(src, arith.muli(row, arith.constant(i64, d // 2)))
        scale_addr = arith.addi(scl, arith.muli(row, arith.constant(i64, d // SCALE_BLOCK)))
        mu.inline_ptx(
            "{ .reg .b64 g; .reg .pred p; setp.ne.b32 p, $1, 0; cvta.to.global.u64 g, $0; @p prefetch.global.L2 [g]; }",
            arith.select(is_scale, scale_addr, data_addr), arith.extui(i32, ok), has_side_effects=True)
        return ()

    return fn


def _interpret_dequant(src_ref, scale_ref, rows_ref, k_ref, bias_ref):
    """Interpret-mode producer: src/scale hold this tile's rows pre-gathered by the wrapper (row order)."""
    valid = rows_ref[...] >= 0
    k = quant.mxfp4_decode(src_ref[...], scale_ref[...])
    k_ref[...] = jnp.where(valid[:, None], k, 0.0).astype(jnp.bfloat16)
    bias_ref[...] = jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def _build_kernel(b: int, s: int, nq: int, d: int, n_tiles: int, num_splits: int, interpret: bool,
                  prefetch: bool = True):
    """q [b, nq, d] bf16, w [b, s, nq] f32 (zero outside query s's heads), rows [b, n_tiles, TILE] int32, live
    [b] int32 (the row's tiles up to its last valid row: `live_tiles`) -> scores f32 [b, s, n_tiles*TILE], written
    for the live tiles only (the rest is left as it was: the wrapper masks it)."""
    t = TILE
    ns = NUM_STAGES
    tps = n_tiles // num_splits
    row_layout = plgpu.Layout.WGMMA.reduce(1)   # one value per entry (acc row)
    col_layout = plgpu.Layout.WGMMA.reduce(0)   # one value per (query, head) column
    tile_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    dequant_fn = None if interpret else _mgpu_dequant_fn(d)
    prefetch_fn = None if (interpret or not prefetch or tps < 2) else _mgpu_prefetch_fn(d)
    # (interpreted, a bare astype pair would be dropped by XLA: scores a bf16 step off from 64 query columns on)
    to_bf16 = ic.bf16_rounder(interpret)

    def body(q_ref, w_ref, src_ref, scale_ref, rows_ref, live_ref, out_ref,
             q_smem, w_smem, k_smem, bias_smem, rows_smem, q_bar, w_bar, rows_bar, ready, consumed):
        bi = lax.axis_index("batch")
        si = lax.axis_index("split")
        wg = lax.axis_index("wg")
        # this CTA's tiles up to the row's last valid entry: a row's context, not the table's width, sets the work
        live = jnp.clip(live_ref[bi] - si * tps, 0, tps)

        @pl.when(wg == 1)
        def _producer():
            plgpu.copy_gmem_to_smem(q_ref.at[bi], q_smem, q_bar)
            plgpu.copy_gmem_to_smem(w_ref.at[bi], w_smem, w_bar)
            plgpu.copy_gmem_to_smem(rows_ref.at[bi, pl.ds(si * tps, tps)], rows_smem, rows_bar)
            plgpu.barrier_wait(rows_bar)

            @pl.loop(0, tps)
            def _tile(ti):
                @pl.when(ti < live)
                def _():
                    slot = lax.rem(ti, ns)
                    if prefetch_fn is not None:
                        @pl.when(ti + 1 < live)
                        def _():
                            plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3)(prefetch_fn)(
                                src_ref, scale_ref, rows_smem.at[jnp.minimum(ti + 1, tps - 1)])

                    @pl.when(ti >= ns)
                    def _():
                        plgpu.barrier_wait(consumed.at[slot])

                    if interpret:
                        lt = si * tps + ti
                        _interpret_dequant(src_ref.at[bi, pl.ds(lt * t, t)], scale_ref.at[bi, pl.ds(lt * t, t)],
                                           rows_smem.at[ti], k_smem.at[slot], bias_smem.at[slot])
                    else:
                        plgpu.inline_mgpu(
                            arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(),
                                       plgpu.RefType(tile_transforms), plgpu.RefType()),
                        )(dequant_fn)(src_ref, scale_ref, rows_smem.at[ti], k_smem.at[slot], bias_smem.at[slot])
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ready.at[slot])

            # Observe the consumer's last releases (every barrier phase observed; the interpreter checks it).
            for j in range(ns):
                tj = live - ns + j

                @pl.when(tj >= 0)
                def _():
                    plgpu.barrier_wait(consumed.at[lax.rem(tj, ns)])

        @pl.when(wg == 0)
        def _consumer():
            plgpu.barrier_wait(q_bar)
            plgpu.barrier_wait(w_bar)

            @pl.loop(0, tps)
            def _tile(ti):
                @pl.when(ti < live)
                def _():
                    slot = lax.rem(ti, ns)
                    plgpu.barrier_wait(ready.at[slot])

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, k_smem.at[slot], q_smem.transpose((1, 0)))
                        return acc_ref[...]

                    acc = pl.run_scoped(qk, plgpu.ACC((t, nq), jnp.float32))      # [T entries, S*IH]
                    bias = plgpu.load(bias_smem.at[slot], layout=row_layout)
                    plgpu.barrier_arrive(consumed.at[slot])                     # K tile no longer needed
                    # bf16(q.k) -> relu; the bf16 x bf16 product is exact in f32, so one rounding gives bf16(x*w).
                    x = jnp.maximum(to_bf16(acc), 0.0)
                    gt = si * tps + ti
                    for qi in range(s):
                        wv = plgpu.load(w_smem.at[qi], layout=col_layout)
                        y = to_bf16(x * lax.broadcast_in_dim(wv, (t, nq), [1]))
                        sc = to_bf16(y.sum(axis=1)) + bias
                        out_ref[bi, qi, pl.ds(gt * t, t)] = sc

    scratch = [
        plgpu.SMEM((nq, d), jnp.bfloat16, transforms=tile_transforms),
        plgpu.SMEM((s, nq), jnp.float32),
        plgpu.SMEM((ns, t, d), jnp.bfloat16, transforms=tile_transforms),
        plgpu.SMEM((ns, t), jnp.float32),
        plgpu.SMEM((tps, t), jnp.int32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=1, num_barriers=ns),
        plgpu.Barrier(num_arrivals=1, num_barriers=ns),
    ]
    kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    # jit-wrapped and cached: lowered once per program, not per call site (see expert_gemm._build_kernel)
    return jax.jit(plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b, s, n_tiles * t), jnp.float32),
        grid=(num_splits, b),
        grid_names=("split", "batch"),
        num_threads=2,
        thread_name="wg",
        kernel_name="indexer_logits",
        scratch_types=scratch,
        **kwargs,
    ))


@functools.cache
def _build_dequant_probe(d: int, interpret: bool):
    """Debug kernel: the producer's gather + dequant of ONE tile into the swizzled smem tile, read back through
    TMA (which un-swizzles) -> bf16 [TILE, d] + bias f32 [TILE]."""
    tile_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    fn = None if interpret else _mgpu_dequant_fn(d)

    def body(src_ref, scale_ref, rows_ref, out_ref, bias_out_ref, k_smem, bias_smem, rows_smem, bar):
        plgpu.copy_gmem_to_smem(rows_ref, rows_smem, bar)
        plgpu.barrier_wait(bar)
        if interpret:
            _interpret_dequant(src_ref, scale_ref, rows_smem, k_smem, bias_smem)
        else:
            plgpu.inline_mgpu(
                arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), plgpu.RefType(tile_transforms),
                           plgpu.RefType()),
            )(fn)(src_ref, scale_ref, rows_smem, k_smem, bias_smem)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, out_ref)
        plgpu.copy_smem_to_gmem(bias_smem, bias_out_ref)
        plgpu.wait_smem_to_gmem(0)

    kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    # jit-wrapped and cached: lowered once per program, not per call site (see expert_gemm._build_kernel)
    return jax.jit(plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((TILE, d), jnp.bfloat16), jax.ShapeDtypeStruct((TILE,), jnp.float32)),
        scratch_types=[plgpu.SMEM((TILE, d), jnp.bfloat16, transforms=tile_transforms),
                       plgpu.SMEM((TILE,), jnp.float32), plgpu.SMEM((TILE,), jnp.int32),
                       plgpu.Barrier(num_arrivals=1)],
        **kwargs,
    ))


def dequant_probe(ik_packed, ik_scale, rows, *, interpret=False):
    """Runs the producer's gather + dequant of one tile. rows int32 [TILE] flat pool rows (-1 = none)
    -> (bf16 [TILE, ID], bias f32 [TILE]); compare with `dequant_rows` (exact)."""
    P, E, half = ik_packed.shape
    src = ik_packed.reshape(P * E, half)
    scl = ik_scale.reshape(P * E, -1)
    rows = jnp.asarray(rows, jnp.int32)
    if interpret:
        g = jnp.maximum(rows, 0)
        src, scl = src[g], scl[g]
    return _build_dequant_probe(2 * half, bool(interpret))(src, scl, rows)


def default_num_splits(batch: int, n_tiles: int, config: KernelConfig = KernelConfig()) -> int:
    """Largest divisor of n_tiles with batch * splits <= max_ctas, raised until tiles/CTA fit the row table."""
    best = 1
    for sp in range(1, n_tiles + 1):
        if n_tiles % sp == 0 and batch * sp <= config.max_ctas:
            best = sp
    while n_tiles // best > config.max_tiles_per_cta:
        best = next(sp for sp in range(best + 1, n_tiles + 1) if n_tiles % sp == 0)
    return best


def live_tiles(rows: jax.Array) -> jax.Array:
    """rows int32 [B, N] (-1 = none) -> int32 [B]: the TILE-entry tiles up to each row's last valid row, the
    tiles the kernel computes. Rows are -1 past a row's visible context (`context_scores`: every entry beyond
    the batch row's newest visible one; candidates: the -1 blocks that pad the ascending list)."""
    n = jnp.arange(1, rows.shape[1] + 1, dtype=jnp.int32)
    last = jnp.max(jnp.where(rows >= 0, n[None], 0), axis=1)
    return (last + TILE - 1) // TILE


def entry_scores_kernel(q, w, ik_packed, ik_scale, rows, *, interpret=False, num_splits=None,
                        config: KernelConfig = KernelConfig()):
    """Mosaic GPU version of `entry_scores_reference`.

    q [B, S, IH, ID] (any float; used as bf16), w [B, S, IH] (used as bf16), ik_packed uint8 [pages, E, ID/2],
    ik_scale uint8 [pages, E, ID/32], rows int32 [B, N] flat pool rows (-1 = none) -> f32 [B, S, N].
    Limits: S*IH % 8 == 0 and <= 256, ID % 64 == 0 and 32 <= ID <= 512."""
    B, S, IH, ID = q.shape
    nq = S * IH
    if nq % 8 or nq > 256:
        raise NotImplementedError(f"S*IH={nq} must be a multiple of 8 and <= 256 (the wgmma N)")
    if ID % 64 or ID > 512:
        raise NotImplementedError(f"ID={ID} must be a multiple of 64, <= 512")
    N = rows.shape[1]
    n_tiles = max(1, -(-N // TILE))
    rows = jnp.pad(jnp.asarray(rows, jnp.int32), ((0, 0), (0, n_tiles * TILE - N)), constant_values=-1)
    if num_splits is None:
        num_splits = default_num_splits(B, n_tiles, config)
    if n_tiles % num_splits:
        raise ValueError(f"{n_tiles=} not divisible by {num_splits=}")
    log.debug("indexer kernel: B=%d S=%d N=%d -> %d splits x %d tiles per CTA", B, S, N, num_splits,
              n_tiles // num_splits)
    qb = q.astype(jnp.bfloat16).reshape(B, nq, ID)
    # Head weights zeroed outside query s's heads: the head sum of query s is one masked row reduction.
    # bf16-rounded weights: reduce_precision, which XLA keeps (it may drop an astype pair under jit)
    wb = lax.reduce_precision(w.astype(jnp.float32), exponent_bits=8, mantissa_bits=7).reshape(B, 1, nq)
    sel = jnp.arange(nq)[None, :] // IH == jnp.arange(S)[:, None]
    wm = jnp.where(sel[None], wb, 0.0)
    P, E, half = ik_packed.shape
    src = ik_packed.reshape(P * E, half)
    scl = ik_scale.reshape(P * E, ID // SCALE_BLOCK)
    if interpret:   # pre-gathered rows (the interpreter cannot run the PTX gather)
        g = jnp.maximum(rows, 0)
        src, scl = src[g], scl[g]
    kern = _build_kernel(B, S, nq, ID, n_tiles, num_splits, bool(interpret), config.prefetch)
    out = kern(qb, wm, src, scl, rows.reshape(B, n_tiles, TILE), live_tiles(rows))
    # tiles past a row's last valid entry are not computed (their rows are all -1: -inf)
    return jnp.where((rows >= 0)[:, None, :N], out[:, :, :N], -jnp.inf)


def entry_scores(q, w, ik_packed, ik_scale, rows, *, backend="pallas", dtype=jnp.bfloat16, **kwargs):
    """backend: 'pallas' (kernel), 'interpret' (kernel in the Mosaic GPU interpreter), 'xla' (the reference,
    rounding to `dtype`; the kernel always rounds to bf16)."""
    if backend == "xla":
        return entry_scores_reference(q, w, ik_packed, ik_scale, rows, dtype)
    if backend in ("pallas", "interpret"):
        return entry_scores_kernel(q, w, ik_packed, ik_scale, rows, interpret=backend == "interpret", **kwargs)
    raise ValueError(f"unknown backend {backend!r}")


# ----------------------------------------------------------------------------------------------------------------
# Scores for the two entry sources, top-k and layer 20's candidate blocks
# ----------------------------------------------------------------------------------------------------------------


def context_scores(q, w, ik_packed, ik_scale, block_table, q_pos, ratio: int, num_entries: int, *,
                   backend="pallas", dtype=jnp.bfloat16, num_splits=None, **kwargs):
    """Scores over entries 0..G-1 (G = num_entries, static) -> f32 [B, S, G]; -inf where not visible
    (same as `indexer.scores` on `_context_index_keys`; a visible entry on a page < 0 or out of range is -inf
    here, 0-key score there).

    Up to `query_group(IH)` queries (decode): this module's kernel, which gathers and dequantizes the entries
    of its row itself. More (a prefill chunk): the entries are dequantized once into dense bf16 keys (exact) and
    `indexer_chunk.chunk_scores` scores every query against them, each key tile shared by two query groups; the
    XLA path's [B, S, IH, G] products are never formed. num_splits goes to whichever kernel runs, kwargs to
    this module's kernel."""
    B, S, IH = q.shape[:3]
    P, E, _ = ik_packed.shape
    nvis = visible_count(q_pos, ratio)                                    # [B, S]
    g = jnp.broadcast_to(jnp.arange(num_entries, dtype=jnp.int32)[None], (B, num_entries))
    g = jnp.where(g < jnp.max(nvis, axis=1, keepdims=True), g, -1)        # entries no query of b sees: skipped
    rows = pool_rows(g, block_table, E, P)
    if backend != "xla" and S > query_group(IH):
        keys = dequant_rows(ik_packed, ik_scale, rows).astype(jnp.bfloat16)
        s = ic.chunk_scores(q, w, keys, nvis, interpret=backend == "interpret", num_splits=num_splits)
    else:
        s = entry_scores(q, w, ik_packed, ik_scale, rows, backend=backend, dtype=dtype, num_splits=num_splits,
                         **kwargs)
    visible = (jnp.arange(num_entries)[None, None] < nvis[..., None]) & (rows >= 0)[:, None]
    return jnp.where(visible, s, -jnp.inf)


def candidate_scores(q, w, ik_packed, ik_scale, block_table, cand_blocks, q_pos, ratio: int, block_size: int = 8,
                     *, backend="pallas", dtype=jnp.bfloat16, **kwargs):
    """Scores of the candidate entries. cand_blocks int32 [B, NB] (S == 1) or [B, S, NB], ascending, -1 = none.
    -> (scores f32 [B, S, NB*bs], entry ids int32 [B, S, NB*bs], -1 where none or not visible)."""
    B, S = q.shape[:2]
    P, E, _ = ik_packed.shape
    cb = jnp.asarray(cand_blocks, jnp.int32)
    if cb.ndim == 2:
        if S != 1:
            raise ValueError("cand_blocks [B, NB] needs S == 1; pass [B, S, NB]")
        cb = cb[:, None]
    nvis = visible_count(q_pos, ratio)
    g = candidate_entries(cb, block_size)                                 # [B, S, N]
    g = jnp.where(g < nvis[..., None], g, -1)
    N = g.shape[-1]
    if S == 1:
        rows = pool_rows(g[:, 0], block_table, E, P)
        s = entry_scores(q, w, ik_packed, ik_scale, rows, backend=backend, dtype=dtype, **kwargs)
    else:   # each query has its own candidates: one kernel row per (b, s)
        bt = jnp.repeat(jnp.asarray(block_table, jnp.int32), S, axis=0)
        rows = pool_rows(g.reshape(B * S, N), bt, E, P)
        s = entry_scores(q.reshape(B * S, 1, *q.shape[2:]), w.reshape(B * S, 1, -1), ik_packed, ik_scale, rows,
                         backend=backend, dtype=dtype, **kwargs).reshape(B, S, N)
    return jnp.where(g >= 0, s, -jnp.inf), g


# How 'auto' picks, from the H200 (scripts/bench_indexer.py: top-k 512, CUPTI GPU time of every kernel of the
# call). After the one-scan placement (`dsv41.topk.positions_from_threshold`) the
# threshold kernel (`topk_select`, with its placement) was the fastest method at every size timed, 1 to 64 rows of
# 2048 to 16384 scores, but by very different margins: 16384-wide rows 51.5 / 32.3 / 30.0 us at 64 / 8 / 1 rows
# against radix select's 96.8 / 66.9 / 56.5 and lax.top_k's 120.9 / 56.3 / 52.8; 2048-wide rows 23.7 / 21.4 us at
# 64 / 1 rows against radix's 47.7 / 43.2 and lax's 24.9 / 23.4. In decode at a 4K context, the kernel for every
# row took batch 64 from 8.48 to 8.08 ms of device time a step (rows that had taken radix select), and batch 1
# from 4.13 to 4.28 ms (rows that had taken lax.top_k; one run each). So the kernel replaces radix select (from
# RADIX_MIN_ROWS rows, up to KERNEL_MAX_ROWS: prefill chunks' rows were not timed) from 2048 scores, and
# lax.top_k (fewer rows) only from 16384 scores, where it is 1.7x faster: KERNEL_MIN_KEYS, the narrowest rows at
# which the kernel replaces each XLA method.
RADIX_MIN_ROWS = 64
KERNEL_MAX_ROWS = 64
KERNEL_MIN_KEYS = {"lax": 16384, "radix": 2048}
TOPK_METHODS = ("auto", "lax", *topk.RADIX_VARIANTS, "kernel")


def auto_topk_method(rows: int, width: int, kernel_ok: bool) -> str:
    """'auto' resolved for `rows` rows of `width` scores: the fastest method measured at that size."""
    xla = "radix" if rows >= RADIX_MIN_ROWS else "lax"
    if kernel_ok and rows <= KERNEL_MAX_ROWS and width >= KERNEL_MIN_KEYS[xla]:
        return "kernel"
    return xla


def topk_positions(s: jax.Array, k: int, method: str = "auto", interpret: bool = False, bf16_values: bool = False,
                   kernel_ok: bool = False) -> jax.Array:
    """Scores [..., N] -> int32 [..., k]: the positions lax.top_k(s, k) picks (ties to the lower position), by
    `method` (as `topk_entries`'), in ascending order except for 'lax' (by value)."""
    if method == "auto":
        method = auto_topk_method(math.prod(s.shape[:-1]), s.shape[-1], kernel_ok or interpret)
    if method == "lax":
        return indexer.lax_positions(s, k)
    if method in topk.RADIX_VARIANTS:
        return topk.top_k_positions(s, k, *topk.RADIX_VARIANTS[method])
    if method == "kernel":
        return topk_select.top_k_positions(s, k, bf16_values=bf16_values, interpret=interpret)
    raise ValueError(f"unknown top-k method {method!r}: one of {list(TOPK_METHODS)}")


def topk_entries(s: jax.Array, entries: jax.Array, k: int, method: str = "auto", interpret: bool = False,
                 bf16_values: bool = False, kernel_ok: bool = False) -> jax.Array:
    """Scores [B, S, N] over entry ids [B, S, N] or [N] (-1 = none/not visible, ascending where valid)
    -> int32 [B, S, min(k, N)]: chosen entry ids ascending, -1 padded at the end. Ties go to the lower id
    (lax.top_k keeps the lower position first; positions ascend with ids) - `indexer.select_topk` semantics.
    method 'lax': lax.top_k (a sort); 'radix' (and the other `dsv41.topk.RADIX_VARIANTS`):
    `dsv41.topk.top_k_positions`, the same positions by radix select (counting passes, no sort of the N
    scores); 'kernel': the same, the k-th largest found by `topk_select` (one Mosaic GPU launch; interpret:
    in the interpreter; bf16_values: every score is a bf16 value, 16 passes); 'auto': `auto_topk_method`
    (kernel_ok: a kernel backend runs, so 'auto' may pick 'kernel')."""
    k = min(k, s.shape[-1])
    if k == 0:
        return jnp.zeros((*s.shape[:-1], 0), jnp.int32)
    pos = topk_positions(s, k, method, interpret, bf16_values, kernel_ok)
    ids = jnp.take_along_axis(jnp.broadcast_to(entries, s.shape), pos, axis=-1)
    big = jnp.iinfo(jnp.int32).max
    ids = jnp.sort(jnp.where(ids >= 0, ids, big), axis=-1)
    return jnp.where(ids == big, -1, ids).astype(jnp.int32)


def _block_select(cfg: IndexerConfig, interpret: bool, bf16_values: bool):
    """The block top-k's selection for `indexer.candidate_blocks`: `topk_select` with cfg.topk_method 'kernel',
    else lax.top_k."""
    if cfg.topk_method == "kernel":
        return lambda blk, kb: topk_select.top_k_positions(blk, kb, bf16_values=bf16_values, interpret=interpret)
    return indexer.lax_positions


def candidate_blocks(s: jax.Array, q_pos: jax.Array, ratio: int, cfg: IndexerConfig = IndexerConfig(),
                     interpret: bool = False, bf16_values: bool = False) -> jax.Array:
    """Layer 20's level one as a block list: context scores [B, S, G] -> int32 [B, S, min(topk_blocks, nb)]
    ascending block ids, -1 padded; the block of the newest visible entry always in. Same set as
    `indexer.candidate_mask` (which returns a per-entry mask). The block top-k by cfg.topk_method ('kernel':
    `topk_select`, interpret: in the interpreter, bf16_values as `topk_entries`; else lax.top_k)."""
    return indexer.candidate_blocks(indexer.block_maxima(s, cfg.candidate_block_size), q_pos, ratio, cfg,
                                    _block_select(cfg, interpret, bf16_values), every_seen_first=False)


def blocks_to_mask(blocks: jax.Array, num_entries: int, block_size: int = 8) -> jax.Array:
    """Block ids [B, S, K] (-1 = none) -> bool entry mask [B, S, G] (what `indexer.candidate_mask` returns)."""
    hit = indexer.block_mask(blocks, -(-num_entries // block_size))
    return jnp.repeat(hit, block_size, axis=-1)[..., :num_entries]


def context_topk_blocks(q, w, ik_packed, ik_scale, block_table, q_pos, ratio: int, *, block_entries: int,
                        want_candidates: bool = False, cfg: IndexerConfig = IndexerConfig(), backend="pallas",
                        dtype=jnp.bfloat16, **kwargs):
    """`index_topk`'s context mode without its [B, S, G] scores (G: the block table's every entry, whatever the
    context): the table in blocks of about block_entries entries (`indexer.block_pages`: at least twice the
    top-k), only the blocks some query sees scored (`context_scores`, a loop with a run-time trip count), each
    merged into the running top k by cfg.topk_method (`indexer.running_topk`); the candidate blocks from the
    blocks' maxima (`indexer.candidate_blocks`). The same entries and blocks as `index_topk` on every row whose
    visible entries lie on its pages (a padding row's may differ). -> as `index_topk`."""
    B, C = block_table.shape
    P, E, _ = ik_packed.shape
    k = min(cfg.index_topk, C * E)
    bs = cfg.candidate_block_size
    bp = indexer.block_pages(C, E, block_entries, 2 * k, bs if want_candidates else 1)
    nblk, W = -(-C // bp), bp * E
    bt = jnp.pad(jnp.asarray(block_table, jnp.int32), ((0, 0), (0, nblk * bp - C)), constant_values=P)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    live = jnp.clip((jnp.max(visible_count(q_pos, ratio)) + W - 1) // W, 1, nblk)
    interpret = backend == "interpret"
    bf16 = backend != "xla" or dtype == jnp.bfloat16  # the kernels' scores are always bf16 values

    def scores_of(i):  # block i's entries are entries 0.. of a table of its pages, seen from q_pos - i W ratio
        return context_scores(q, w, ik_packed, ik_scale, lax.dynamic_slice_in_dim(bt, i * bp, bp, axis=1),
                              q_pos - i * W * ratio, ratio, W, backend=backend, dtype=dtype, **kwargs)

    def select(s, n):
        return topk_positions(s, n, cfg.topk_method, interpret, bf16, backend != "xla")

    ids, maxima = indexer.running_topk(scores_of, nblk, live, k, select, bs if want_candidates else 0)
    cand = (indexer.candidate_blocks(maxima, q_pos, ratio, cfg, _block_select(cfg, interpret, bf16))
            if want_candidates else None)
    return indexer.visible_ids(ids, q_pos, ratio), cand


def index_topk(q, w, ik_packed, ik_scale, block_table, q_pos, ratio: int, *, cand_blocks=None,
               num_entries: int | None = None, want_candidates: bool = False,
               cfg: IndexerConfig = IndexerConfig(), backend="pallas", dtype=jnp.bfloat16, **kwargs):
    """The engine's entry point: scores + top-k for one indexer layer (dtype: the reference's rounding).

    q [B, S, IH, ID], w [B, S, IH], ik_packed/ik_scale: one source layer's pool, block_table [B, max_pages],
    q_pos [B, S] int32. Exactly one of:
      cand_blocks [B, NB] / [B, S, NB]  -> layers after the candidate source: score only the candidate entries;
      num_entries G (static)            -> all entries 0..G-1 (encoder indexers, layer 20).
    Returns (topk int32 [B, S, k] ascending entry ids, -1 padded, k = min(index_topk, N);
             candidate blocks int32 [B, S, <=candidate_topk_blocks] if want_candidates (context mode) else None).
    """
    if (cand_blocks is None) == (num_entries is None):
        raise ValueError("pass exactly one of cand_blocks / num_entries")
    bf16 = backend != "xla" or dtype == jnp.bfloat16  # the kernels' scores are always bf16 values
    if cand_blocks is not None:
        s, g = candidate_scores(q, w, ik_packed, ik_scale, block_table, cand_blocks, q_pos, ratio,
                                cfg.candidate_block_size, backend=backend, dtype=dtype, **kwargs)
        return topk_entries(s, g, cfg.index_topk, cfg.topk_method, backend == "interpret", bf16,
                            backend != "xla"), None
    s = context_scores(q, w, ik_packed, ik_scale, block_table, q_pos, ratio, num_entries, backend=backend,
                       dtype=dtype, **kwargs)
    g = jnp.arange(num_entries, dtype=jnp.int32)
    g = jnp.where(g[None, None] < visible_count(q_pos, ratio)[..., None], g, -1)
    cand = candidate_blocks(s, q_pos, ratio, cfg, backend == "interpret", bf16) if want_candidates else None
    return topk_entries(s, g, cfg.index_topk, cfg.topk_method, backend == "interpret", bf16, backend != "xla"), cand


# ----------------------------------------------------------------------------------------------------------------
# Today's XLA decode path (serving/engine/programs.py), for benchmarks and equivalence tests
# ----------------------------------------------------------------------------------------------------------------


def index_topk_xla_today(q, w, ik_packed, ik_scale, block_table, q_pos, ratio: int, cand_mask=None,
                         cfg: IndexerConfig = IndexerConfig()):
    """`_context_index_keys` (dequantize every entry of the row's pages) + `indexer.scores` + candidate mask
    + `indexer.select_topk`. cand_mask bool [B, S, G] or None. -> int32 [B, S, min(index_topk, G)]."""
    from dsv41.quant import REFERENCE

    bt = jnp.asarray(block_table, jnp.int32)
    packed = ik_packed.at[bt].get(mode="fill", fill_value=0)
    scale = ik_scale.at[bt].get(mode="fill", fill_value=0)
    keys = quant.mxfp4_decode(packed, scale).reshape(bt.shape[0], -1, q.shape[-1])
    s = indexer.scores(q, w, keys, q_pos, ratio, REFERENCE)
    if cand_mask is not None:
        s = jnp.where(cand_mask, s, -jnp.inf)
    return indexer.select_topk(s, q_pos, ratio, cfg)
