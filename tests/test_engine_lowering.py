"""The engine's programs with the Mosaic GPU kernels (KV path, expert GEMM, FP8 linears, mHC and router sites), lowered for CUDA on the CPU at the bench preset's shapes
(Flash's per-layer widths). Lowering runs every kernel's Pallas -> Mosaic GPU pass (layouts, TMA boxes, shared
memory, wgmma shapes) at the shapes the engine really passes, which the kernels' own tests at their own shapes
can miss: two decode rows give the expert GEMM 12 token rows, which once failed on the H200 ("dimension 0 must
have size smaller or a multiple of its tiling 8"). Nothing is allocated: parameters and pool are abstract."""

import jax
import jax.numpy as jnp
import pytest

from dsv41 import model, moe, quant
from dsv41 import params as P
from dsv41.config import preset
from serving.engine import kv_pool, programs

SD = jax.ShapeDtypeStruct
# the decode programs are lowered once (module fixtures) and read by several tests: one worker takes the file
pytestmark = pytest.mark.xdist_group("engine_lowering")
ALL_SITES = model.Sites(mhc="pallas", router="pallas")


@pytest.fixture(scope="module")
def bench():
    cfg = preset("bench")
    core, _ = model.strip_tables(P.abstract_params(cfg))
    core = jax.eval_shape(moe.prepare_experts, core)  # the routed experts in the FP4 kernel's layout
    pool = kv_pool.abstract_pool(cfg, kv_pool.PoolLayout(num_pages=64, page_tokens=64, num_slots=8))
    return cfg, core, pool


def _batch(cfg, B, T, ctx_pages, rows_sharding=None):
    i = lambda *s: SD(s, jnp.int32)  # noqa: E731
    shape = (B, T, cfg.engram_n_cols, cfg.engram_head_dim)
    rows = [quant.Fp8Rows(SD(shape, jnp.float8_e4m3fn, sharding=rows_sharding),
                          SD((*shape[:-1], shape[-1] // 32), jnp.uint8, sharding=rows_sharding))
            for _ in cfg.engram_layer_ids]
    return programs.Batch(i(B, T), i(B), i(B), i(B), i(B, ctx_pages), i(B), rows)


def _sampling(B):
    return programs.Sampling(SD((B,), jnp.float32), SD((B,), jnp.float32), SD((B,), jnp.int32),
                             SD((B, 2), jnp.uint32))


@pytest.fixture(scope="module")
def decode_hlo(bench):
    """The decode step of test_decode_lowers_for_cuda, lowered once for the tests that read it: its Engram rows
    pinned-host arguments (engram_transfer="overlap")."""
    cfg, core, pool = bench
    B = 2
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    return programs.run_full.trace(core, pool, _batch(cfg, B, 1, 8, pinned), _sampling(B), cfg=cfg,
                                   num=quant.REFERENCE, backend="pallas", sites=ALL_SITES,
                                   opts=programs.KernelOptions(indexer_topk="kernel", fuse_rope=False)).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.fixture(scope="module")
def decode_fp8_hlo(bench):
    """The decode step of test_decode_with_fp8_linear_kernel_lowers_for_cuda (Engram rows on the device), lowered
    once for the tests that read it."""
    from dsv41 import nn

    cfg, core, pool = bench
    B = 64
    core = jax.eval_shape(lambda c: nn.prepare_linears(c, cfg), core)
    return programs.run_full.trace(core, pool, _batch(cfg, B, 1, 8), _sampling(B), cfg=cfg, num=quant.REFERENCE,
                                   backend="pallas", sites=model.Sites(mhc="pallas")).lower(
        lowering_platforms=("cuda",)).as_text()


def test_decode_lowers_for_cuda(decode_hlo):
    """Every kernel of the decode step with the options off their defaults: the indexers' top-k threshold kernel
    (`KernelOptions(indexer_topk="kernel")`: in the program with the option) and q / o rotated in XLA around the
    attention kernel (`fuse_rope=False`). The FP8 test below lowers the defaults (RoPE inside the kernel: several
    key splits, the output's rotation in the XLA combine; XLA's top-k) and finds the threshold kernel absent."""
    assert "topk_threshold" in decode_hlo
    with pytest.raises(ValueError, match="indexer_topk"):
        programs.KernelOptions(indexer_topk="sort")


def test_decode_with_fp8_linear_kernel_lowers_for_cuda(decode_fp8_hlo):
    """`--linear-backend pallas`: the FP8 linears (attention projections, shared expert, Engram) through the FP8
    linear kernel, each with its own K split, at 64 decode rows."""
    assert "topk_threshold" not in decode_fp8_hlo  # the default top-k is XLA's (the threshold kernel: an option)


def test_engram_rows_in_pinned_host_memory_are_copied_inside_the_program(bench, decode_hlo, decode_fp8_hlo):
    """Engine(engram_transfer="overlap"): the rows are pinned-host arguments and the program moves them to the
    device itself (annotate_device_placement, which XLA's host-offload passes turn into an asynchronous copy:
    copy-start, copy-done before the Engram layer), one per row array. Read from the decode programs lowered
    above (with the kernels: a separate lowering of the XLA path's program cost ~10 s of CPU time and checked the
    same placement code, `programs.run_full`'s, which is the same for every backend)."""
    cfg = bench[0]
    n_arrays = 2 * len(cfg.engram_layer_ids)
    assert decode_hlo.count('mhlo.memory_kind = "pinned_host"') == n_arrays
    assert decode_hlo.count("annotate_device_placement") == n_arrays
    assert "annotate_device_placement" not in decode_fp8_hlo  # rows already on the device: no copy


def test_prefill_chunk_lowers_for_cuda(bench):
    """A 2048-token chunk: 12288 expert rows (the GEMM's prefill tiles), 2048 attention kernel rows. With the
    defaults (`KernelOptions()`) the encoder's indexers run through the chunk kernel (`indexer_chunk`: the keys
    dequantized once, two groups of 8 queries x 32 heads sharing each key tile) and the RoPE inside the attention
    kernel's epilogue (one split); with both options off, neither: the indexers in XLA, q / o rotated in XLA (the
    options are part of the programs' cache key)."""
    cfg, core, pool = bench

    def lowered(opts):
        return programs.run_encoder.trace(core, pool, _batch(cfg, 1, 2048, 8), cfg=cfg, num=quant.REFERENCE,
                                          backend="pallas", sites=ALL_SITES, opts=opts).lower(
            lowering_platforms=("cuda",)).as_text()

    assert "indexer_chunk" in lowered(programs.KernelOptions())
    assert "indexer_chunk" not in lowered(programs.KernelOptions(prefill_indexer_kernel=False, fuse_rope=False))
