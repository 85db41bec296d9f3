"""The fused kernels' path through every layer's attention against the XLA path, on the tiny preset's parameters
(tests/test_engine.py's: float32 activations with the serving formats' KV numerics).

No engine runs here: the test builds its own batches and pool and compiles its own two programs, so it stays out of
the engine tests' xdist group (`tiny_engine.GROUP`, one worker) and either worker takes it."""

import numpy as np
import tiny_engine

from dsv41 import model
from serving.engine import kv_pool
from serving.engine.backends import KernelOptions
from tiny_engine import NUM

# the defaults, and every option at its other setting (the suite's time: ~25 s a program on CI, so both settings'
# kernel paths share one program a phase with the XLA path: layer_paths.attention_diffs_each)
KERNEL_OPTIONS = {"default": KernelOptions(),
                  "unfused-rope+xla-indexer+kernel-topk": KernelOptions(
                      fuse_rope=False, prefill_indexer_kernel=False, indexer_topk="kernel"),
                  "indexer-blocks": KernelOptions(prefill_indexer_block_entries=64)}


def test_fused_kernel_path_equals_xla_layer_by_layer():
    """Every layer's attention through the fused kernels' inputs (FP8 window rows, page tables, top-k entries;
    their jnp references on the CPU) equals the XLA path's from the same state: a prefill chunk whose windows
    reach into the ring (two rows, one ragged) and a decode step with its fused KV writes and indexer; with each
    setting of `backends.KernelOptions` (the query / output RoPE handed to the attention kernel or not, the
    prefill chunk's indexer through the scoring kernel or XLA, over the whole block table or by blocks, the top-k
    by XLA or, through its reference, the threshold kernel). The kernels against those references:
    tests/pallas_kernels; the compiled kernels: tests/test_engine_gpu.py."""
    from layer_paths import attention_diffs_each, make_batch, zero_rows

    cfg, params = tiny_engine.tiny()
    core, _ = model.strip_tables(params)
    pool = kv_pool.allocate(cfg, kv_pool.PoolLayout(num_pages=16, page_tokens=64, num_slots=2))
    B, T, ctx = 2, 128, 6
    bt = np.arange(B * ctx).reshape(B, ctx)
    tokens = np.asarray([tiny_engine.prompt(T, 20), tiny_engine.prompt(T, 21)], np.int32)
    opts = list(KERNEL_OPTIONS.values())
    # the first chunk fills the pool through the XLA path of the program the prefill phase runs (the same
    # shapes: one CPU compile of ~10 s fewer than the engine's run_full), its diffs checked as well
    L = cfg.n_layers
    first, pool = attention_diffs_each(core, pool, make_batch(tokens, 0, [T, T], [0, 1], bt, zero_rows(cfg, B, T), L),
                                       cfg, NUM, "reference", opts, with_pool=True)
    per_phase = {
        "first chunk": first,
        "prefill": attention_diffs_each(core, pool, make_batch(tokens[:, ::-1].copy(), T, [T, 77], [0, 1], bt,
                                                               zero_rows(cfg, B, T), L), cfg, NUM, "reference", opts,
                                        with_pool=True)[0],
        "decode": attention_diffs_each(core, pool, make_batch(tokens[:, :1].copy(), 2 * T, [1, 1], [0, 1], bt,
                                                              zero_rows(cfg, B, 1), L), cfg, NUM, "reference", opts),
    }
    worst = {(name, phase): d for phase, ds in per_phase.items() for name, d in zip(KERNEL_OPTIONS, ds)}
    assert max(float(d.max()) for d in worst.values()) < 1e-5, worst
