"""The engine's programs with the Mosaic GPU kernels (KV path, expert GEMM, FP8 linears, mHC and router sites),
lowered for CUDA on the CPU at the bench preset's shapes (Flash's per-layer widths). Lowering runs every kernel's
Pallas -> Mosaic GPU pass (layouts, TMA boxes, shared memory, wgmma shapes) at the shapes the engine really passes,
which the kernels' own tests at their own shapes can miss: two decode rows give the expert GEMM 12 token rows,
which once failed on the H200 ("dimension 0 must have size smaller or a multiple of its tiling 8"). Nothing is
allocated: parameters and pool are abstract."""

import jax
import jax.numpy as jnp
import pytest

from dsv41 import model, quant
from dsv41 import params as P
from dsv41.config import preset
from serving.engine import backends as BK
from serving.engine import kv_pool, programs

SD = jax.ShapeDtypeStruct
# the decode programs are lowered once (module fixtures) and read by several tests: one worker takes the file
pytestmark = pytest.mark.xdist_group("engine_lowering")
# the MoE through the FP4 kernel (`bench` prepares its experts), both fused sites at every size
ALL_KERNELS = BK.kernel_ops(experts=True, mhc="pallas", router="pallas")


@pytest.fixture(scope="module")
def bench():
    cfg = preset("bench")
    core, _ = model.strip_tables(P.abstract_params(cfg))
    core = jax.eval_shape(BK.prepare_experts, core)  # the routed experts in the FP4 kernel's layout
    pool = kv_pool.abstract_pool(cfg, kv_pool.PoolLayout(num_pages=64, page_tokens=64, num_slots=8))
    return cfg, core, pool


def _batch(cfg, B, T, ctx_pages):
    i = lambda *s: SD(s, jnp.int32)  # noqa: E731
    shape = (B, T, cfg.engram_n_cols, cfg.engram_head_dim)
    rows = [quant.Fp8Rows(SD(shape, jnp.float8_e4m3fn),
                          SD((*shape[:-1], shape[-1] // 32), jnp.uint8))
            for _ in cfg.engram_layer_ids]
    return programs.Batch(i(B, T), i(B), i(B), i(B), i(B, ctx_pages), i(B), i(B, cfg.n_layers), rows)


@pytest.fixture(scope="module")
def decode_hlo(bench):
    """The decode step of test_decode_lowers_for_cuda, lowered once for the tests that read it."""
    cfg, core, pool = bench
    B = 2
    be = BK.Backends("pallas", BK.KernelOptions(indexer_topk="kernel", fuse_rope=False), ALL_KERNELS)
    return programs.run_full.trace(core, pool, _batch(cfg, B, 1, 8), cfg=cfg,
                                   num=quant.REFERENCE, backends=be).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.fixture(scope="module")
def decode_fp8_hlo(bench):
    """The decode step of test_decode_with_fp8_linear_kernel_lowers_for_cuda (Engram rows on the device), lowered
    once for the tests that read it."""
    cfg, core, pool = bench
    B = 64
    core = jax.eval_shape(lambda c: BK.prepare_linears(c, cfg), core)
    ops = BK.kernel_ops(experts=True, linears=True, mhc="pallas")
    return programs.run_full.trace(core, pool, _batch(cfg, B, 1, 8), cfg=cfg, num=quant.REFERENCE,
                                   backends=BK.Backends("pallas", ops=ops)).lower(
        lowering_platforms=("cuda",)).as_text()


def test_decode_lowers_for_cuda(decode_hlo):
    """Every kernel of the decode step with the options off their defaults: the indexers' top-k threshold kernel
    (`KernelOptions(indexer_topk="kernel")`: in the program with the option) and q / o rotated in XLA around the
    attention kernel (`fuse_rope=False`). The FP8 test below lowers the defaults (RoPE inside the kernel: several
    key splits, the output's rotation in the XLA combine; XLA's top-k) and finds the threshold kernel absent."""
    assert "topk_threshold" in decode_hlo
    with pytest.raises(ValueError, match="indexer_topk"):
        BK.KernelOptions(indexer_topk="sort")


def test_decode_with_fp8_linear_kernel_lowers_for_cuda(decode_fp8_hlo):
    """`--linear-backend pallas`: the FP8 linears (attention projections, shared expert, Engram) through the FP8
    linear kernel, each with its own K split, at 64 decode rows."""
    assert "topk_threshold" not in decode_fp8_hlo  # the default top-k is XLA's (the threshold kernel: an option)


def test_prefill_chunk_lowers_for_cuda(bench):
    """A 2048-token chunk: 12288 expert rows (the GEMM's prefill tiles), 2048 attention kernel rows. With the
    defaults (`KernelOptions()`) the encoder's indexers run through the chunk kernel (`indexer_chunk`: the keys
    dequantized once, two groups of 8 queries x 32 heads sharing each key tile) and the RoPE inside the attention
    kernel's epilogue (one split); with both options off, neither: the indexers in XLA, q / o rotated in XLA (the
    options are part of the programs' cache key). By blocks (`prefill_indexer_block_entries`: a 64-page table,
    2048 entries at ratio 2, in blocks of 1024), the chunk kernel inside the loop over the blocks a chunk sees."""
    cfg, core, pool = bench

    def lowered(opts, T=2048, pages=8):
        return programs.run_encoder.trace(core, pool, _batch(cfg, 1, T, pages), cfg=cfg, num=quant.REFERENCE,
                                          backends=BK.Backends("pallas", opts, ALL_KERNELS)).lower(
            lowering_platforms=("cuda",)).as_text()

    assert "indexer_chunk" in lowered(BK.KernelOptions())
    assert "indexer_chunk" not in lowered(BK.KernelOptions(prefill_indexer_kernel=False, fuse_rope=False))
    blocks = lowered(BK.KernelOptions(prefill_indexer_block_entries=1024), T=256, pages=64)
    assert "indexer_chunk" in blocks and "stablehlo.while" in blocks
