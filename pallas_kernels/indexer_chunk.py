"""Indexer logits of a prefill chunk: many queries against one sequence's index keys (Mosaic GPU).

For query i of row b and key n:

    score[b, i, n] = bf16( sum_h bf16( relu( bf16(q[b,i,h,:] . k[b,n,:]) ) * w[b,i,h] ) )
                     (-inf where n >= nvis[b, i])

with the rounding steps of `dsv41.indexer.raw_scores` (`chunk_scores_reference`), returned as float32.

Why a kernel beside `indexer_logits`: that one gathers and dequantizes the MXFP4 keys in its producer for at most
256 query-heads (one decode query at Flash's 32 heads, or 8 queries of a chunk). Over a 2048-token chunk it
repeats the gather and the dequantization for every 8 queries, and a 64K prefill ran 32% slower through it than
through XLA on the H200. XLA in turn writes the [queries, heads, entries]
products of its q.k GEMM to HBM and reads them back for the ReLU, weights and head sum (8 bytes a product in
float32, 4 in bf16), which grows with the context as the GEMM does. Here the caller dequantizes the keys once
into a dense bf16 [B, G, ID] (bf16 holds every MXFP4 value exactly; 2 * ID bytes a key), the kernel streams them
by TMA, each key tile in shared memory serves two query groups, and the products never leave registers.

Kernel (grid: query blocks x key splits x rows; 3 warpgroups):
  * WG2 (producer): TMA-loads key tiles [TILE, ID] into NUM_STAGES swizzled shared buffers; tiles beyond the
    last key any query of the block sees are skipped (the causal part of a chunk, and the unused end of the
    context bucket).
  * WG0, WG1 (consumers): each loads one query group's q [nq, ID] (nq = group x heads <= 256) and head weights
    into shared memory; per tile S^T = K Q^T by wgmma ([TILE keys, nq] float32, keys are M, query-heads N, ID
    is K), releases the stage, then per query its heads' columns: bf16, ReLU, times its weights, bf16, head sum,
    bf16: one score per key, stored as bf16 (exact; the scores [S, G] are the kernel's one large output).
Query blocks run fastest in the grid, so the CTAs resident at once stream the same key tiles (from L2 after the
first).
Skipped tiles leave their output unwritten; `chunk_scores` masks every key beyond a query's visible count.

Interpret mode (CPU): the same body in the Mosaic GPU interpreter (no register budget calls).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from dsv41 import indexer

log = logging.getLogger(__name__)

TILE = 64            # keys per tile = wgmma M
NUM_STAGES = 3       # shared-memory stages of key tiles
NUM_CONSUMERS = 2    # query groups sharing each key tile
NUM_SMS = 132
MAX_N = 256          # wgmma N: query-heads of one group
# setmaxnreg budget (3 warpgroups: 2 * 216 + 72 <= 3 * 168, as the attention kernel): a consumer holds the
# [64, 256] float32 accumulator (128 registers a thread) plus its epilogue
CONSUMER_REGS, PRODUCER_REGS = 216, 72


def bf16_rounder(interpret: bool):
    """float32 -> float32 rounded to bf16, as the GPU's conversion rounds. The interpreter runs kernel bodies as
    XLA ops, and XLA drops a bare astype(bf16).astype(f32) pair (excess precision), so there it is
    reduce_precision, which XLA keeps."""
    if interpret:
        return lambda v: lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)
    return lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)


def query_group(index_heads: int) -> int:
    """Queries whose heads make one wgmma N (<= 256)."""
    return max(1, MAX_N // index_heads)


def chunk_scores_reference(q, w, keys, nvis, dtype=jnp.bfloat16):
    """q [B, S, IH, ID], w [B, S, IH], keys [B, G, ID], nvis int32 [B, S] -> f32 [B, S, G] (plain jnp)."""
    s = indexer.raw_scores(q, w, keys, dtype)
    return jnp.where(jnp.arange(keys.shape[1])[None, None] < nvis[..., None], s, -jnp.inf)


def default_num_splits(ctas: int, n_tiles: int) -> int:
    """Key splits: the smallest divisor of n_tiles that gives every SM a CTA (one fits an SM: 178 KB of shared
    memory at Flash's shapes), since each split reloads its queries."""
    for sp in range(1, n_tiles + 1):
        if n_tiles % sp == 0 and ctas * sp >= NUM_SMS:
            return sp
    return n_tiles


@functools.cache
def _build_kernel(b: int, n_blocks: int, ih: int, qpg: int, d: int, n_tiles: int, num_splits: int,
                  interpret: bool):
    """q [b, n_blocks*NC, qpg*ih, d] bf16, w [b, n_blocks*NC, qpg, ih] f32 (bf16 values), keys [b, n_tiles*TILE,
    d] bf16, live [b, n_blocks] int32 (key tiles some query of the block sees) -> bf16 [b, n_blocks*NC*qpg,
    n_tiles*TILE] (a score is a bf16 value: stored as one, half the bytes of float32)."""
    t, ns, nc = TILE, NUM_STAGES, NUM_CONSUMERS
    nq = qpg * ih
    tps = n_tiles // num_splits
    col_layout = plgpu.Layout.WGMMA.reduce(0)   # one value per query-head (accumulator column)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    to_bf16 = bf16_rounder(interpret)

    def body(q_ref, w_ref, k_ref, live_ref, out_ref, q_smem, w_smem, k_smem, q_bar, ready, consumed):
        bi = lax.axis_index("batch")
        qb = lax.axis_index("qblock")
        si = lax.axis_index("split")
        wg = lax.axis_index("wg")
        live = jnp.clip(live_ref[bi, qb] - si * tps, 0, tps)   # this CTA's tiles that some query sees

        @pl.when(wg == nc)
        def _producer():
            if not interpret:
                plgpu.set_max_registers(PRODUCER_REGS, action="decrease")

            @pl.loop(0, tps)
            def _tile(ti):
                @pl.when(ti < live)
                def _():
                    slot = lax.rem(ti, ns)

                    @pl.when(ti >= ns)
                    def _():
                        plgpu.barrier_wait(consumed.at[slot])

                    plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds((si * tps + ti) * t, t)], k_smem.at[slot],
                                            ready.at[slot])

            # Drain: observe the consumers' releases of the last stages (every barrier phase is observed by
            # all its users; the interpreter checks it).
            for j in range(ns):
                tj = live - ns + j

                @pl.when(tj >= 0)
                def _():
                    plgpu.barrier_wait(consumed.at[lax.rem(tj, ns)])

        @pl.when(wg < nc)
        def _consumer():
            if not interpret:
                plgpu.set_max_registers(CONSUMER_REGS, action="increase")
            qg = qb * nc + wg
            plgpu.copy_gmem_to_smem(q_ref.at[bi, qg], q_smem.at[wg], q_bar.at[wg])
            plgpu.copy_gmem_to_smem(w_ref.at[bi, qg], w_smem.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])

            @pl.loop(0, tps)
            def _tile(ti):
                @pl.when(ti < live)
                def _():
                    slot = lax.rem(ti, ns)
                    plgpu.barrier_wait(ready.at[slot])

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, k_smem.at[slot], q_smem.at[wg].transpose((1, 0)))
                        return acc_ref[...]

                    acc = pl.run_scoped(qk, plgpu.ACC((t, nq), jnp.float32))   # [TILE keys, query-heads]
                    plgpu.barrier_arrive(consumed.at[slot])                     # the key tile is free
                    # bf16(q.k) -> ReLU; a bf16 x bf16 product is exact in float32, so one rounding after the
                    # weight multiply is the bf16 multiply
                    x = jnp.maximum(to_bf16(acc), 0.0)
                    col0 = (si * tps + ti) * t
                    for j in range(qpg):   # query j of the group: its heads are columns j*ih .. (j+1)*ih
                        wj = plgpu.load(w_smem.at[wg, j], layout=col_layout)
                        y = to_bf16(x[:, j * ih:(j + 1) * ih] * lax.broadcast_in_dim(wj, (t, ih), [1]))
                        out_ref[bi, qg * qpg + j, pl.ds(col0, t)] = y.sum(axis=1).astype(jnp.bfloat16)

    scratch = [
        plgpu.SMEM((nc, nq, d), jnp.bfloat16, transforms=transforms),
        plgpu.SMEM((nc, qpg, ih), jnp.float32),
        plgpu.SMEM((ns, t, d), jnp.bfloat16, transforms=transforms),
        plgpu.Barrier(num_arrivals=2, num_barriers=nc),     # q_bar: a group's queries and weights
        plgpu.Barrier(num_arrivals=1, num_barriers=ns),     # ready: a key tile landed
        plgpu.Barrier(num_arrivals=nc, num_barriers=ns),    # consumed: both groups are done with it
    ]
    kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    # jit-wrapped and cached: lowered once per program, not per call site (see expert_gemm._build_kernel)
    return jax.jit(plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b, n_blocks * nc * qpg, n_tiles * t), jnp.bfloat16),
        grid=(n_blocks, num_splits, b),
        grid_names=("qblock", "split", "batch"),
        num_threads=nc + 1,
        thread_name="wg",
        kernel_name="indexer_chunk",
        scratch_types=scratch,
        **kwargs,
    ))


def chunk_scores(q, w, keys, nvis, *, interpret: bool = False, num_splits: int | None = None):
    """Mosaic GPU version of `chunk_scores_reference`.

    q [B, S, IH, ID] (used as bf16), w [B, S, IH] (used as bf16), keys [B, G, ID] (bf16 values: an MXFP4 key
    dequantized is one), nvis int32 [B, S] (keys 0 .. nvis-1 visible to the query) -> f32 [B, S, G].
    Limits: IH a multiple of 8 and <= 256 (a query's heads are a column slice of the wgmma tile), ID a
    multiple of 64, <= 256 (the 128-byte swizzle; shared memory)."""
    B, S, IH, ID = q.shape
    G = keys.shape[1]
    if IH % 8 or IH > MAX_N:
        raise NotImplementedError(f"index heads {IH} must be a multiple of 8 and <= {MAX_N}")
    if ID % 64 or ID > 256:
        raise NotImplementedError(f"index head dim {ID} must be a multiple of 64 and <= 256")
    qpg = query_group(IH)
    per_block = NUM_CONSUMERS * qpg
    n_blocks = -(-S // per_block)
    pad_s = n_blocks * per_block - S
    n_tiles = max(1, -(-G // TILE))
    if num_splits is None:
        num_splits = default_num_splits(B * n_blocks, n_tiles)
    if n_tiles % num_splits:
        raise ValueError(f"{n_tiles=} not divisible by {num_splits=}")
    log.debug("indexer chunk kernel: B=%d S=%d G=%d -> %d query blocks x %d splits", B, S, G, n_blocks, num_splits)
    nvis = jnp.asarray(nvis, jnp.int32)
    qb = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, pad_s), (0, 0), (0, 0)))
    qb = qb.reshape(B, n_blocks * NUM_CONSUMERS, qpg * IH, ID)
    # bf16-rounded weights: reduce_precision, which XLA keeps (it may drop an astype pair under jit)
    wb = lax.reduce_precision(w.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)
    wb = jnp.pad(wb, ((0, 0), (0, pad_s), (0, 0))).reshape(B, n_blocks * NUM_CONSUMERS, qpg, IH)
    kb = jnp.pad(keys.astype(jnp.bfloat16), ((0, 0), (0, n_tiles * TILE - G), (0, 0)))
    seen = jnp.pad(jnp.minimum(nvis, G), ((0, 0), (0, pad_s))).reshape(B, n_blocks, per_block).max(axis=-1)
    live = (seen + TILE - 1) // TILE                                               # [B, n_blocks]
    out = _build_kernel(B, n_blocks, IH, qpg, ID, n_tiles, num_splits, bool(interpret))(qb, wb, kb, live)
    visible = jnp.arange(G)[None, None] < nvis[..., None]
    return jnp.where(visible, out[:, :S, :G].astype(jnp.float32), -jnp.inf)
