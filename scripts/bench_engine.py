"""Engine benchmarks on one GPU with the `bench` preset (Flash's per-layer widths, 8 layers, 64 experts): prefill
with SWA bounded replay on vs off against the matmul rate, decode step time against the HBM roofline, host
overhead, compile times (ceilings: scripts/timing.py). Prints markdown tables for docs/PERFORMANCE.md.

    PYTHONPATH=. python3 scripts/bench_engine.py [--lengths 1024,4096,16384] [--batches 1,8,64]
        [--decode-max-model-len 16384,65536]   (a decode at --decode-ctx in engines of each size)

Scanned runs of layers (dsv41/layer_runs.py; the bench schedule's runs are all one layer) against every layer
unrolled, at Flash's 40-layer schedule (the release's weight formats: 40 layers of bf16 experts do not fit):

    PYTHONPATH=. python3 scripts/bench_engine.py --schedule flash --weights release --backends auto \
        --batches 1,64 --skip-prefill [--scan-layers|--no-scan-layers]

Random weights made on the device: dense bf16, the routed experts in FP4 where the FP4 expert GEMM runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41 import layer_runs, model, quant
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import preset
from serving.engine import programs
from serving.engine.backends import KernelOptions
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine, SamplingParams, _Request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import ceilings, median_wall_s as timed  # noqa: E402

log = logging.getLogger("bench_engine")


def device_params(cfg, seed=0):
    """Dense bf16 weights drawn on the device; Engram tables as host zeros (read by row, never on the GPU)."""
    specs = P.param_specs(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, P.Spec))
    key = jax.random.key(seed)
    out = []
    for i, s in enumerate(leaves):
        if s.fmt == "table":
            out.append(quant.Fp8Rows(np.zeros(s.shape, ml_dtypes.float8_e4m3fn),
                                     np.full((s.shape[0], s.shape[1] // 32), 127, np.uint8)))
            continue
        dt = jnp.float32 if s.fmt == "f32" else jnp.bfloat16
        if s.init == "ones":
            out.append(jnp.ones(s.shape, dt))
            continue
        std = {"small": 0.1, "hc": 0.5 / math.sqrt(s.shape[-1]), "embed": 1.0}.get(s.init, 1 / math.sqrt(s.shape[-1]))
        out.append((jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32) * std).astype(dt))
    return jax.tree_util.tree_unflatten(treedef, out)


# --backends names -> (attention, routed experts, mHC site, router site, FP8 linears); 'auto' is what
# `dsv41 serve` runs (with --weights release, the FP8 linear kernel too); 'fp8' = auto + the FP8 linear kernel,
# which fails without FP8 linears (--weights release); 'xla-linears' = auto with XLA's FP8 linears
KERNELS = {"xla": ("xla", "xla", "xla", "xla", "xla"), "attn": ("pallas", "xla", "xla", "xla", "xla"),
           "pallas": ("pallas", "pallas", "xla", "xla", "xla"), "all": ("pallas", "pallas", "pallas", "pallas", "xla"),
           "auto": ("auto", "auto", "auto", "auto", "auto"), "fp8": ("auto", "auto", "auto", "auto", "pallas"),
           "xla-linears": ("auto", "auto", "auto", "auto", "xla")}


# configuration suffixes (auto+unfused-rope+kernel-topk): what each changes from the engine's defaults
SUFFIXES = {"unfused-rope": "q / o rotated in XLA around the attention kernel (KernelOptions(fuse_rope=False))",
            "xla-indexer": "prefill chunks' indexers in XLA, not through the scoring kernels "
                           "(KernelOptions(prefill_indexer_kernel=False))",
            "kernel-topk": "the indexers' top-k threshold by topk_select (KernelOptions(indexer_topk='kernel'))"}


def kernels_of(config: str) -> tuple[str, ...]:
    """A configuration name -> its kernel backends (KERNELS); suffixes after '+' (SUFFIXES) change one option."""
    name, *suffixes = config.split("+")
    unknown = [s for s in suffixes if s not in SUFFIXES]
    if name not in KERNELS or unknown:
        raise SystemExit(f"configuration {config!r}: choose one of {sorted(KERNELS)}, optionally with "
                         f"+{' +'.join(SUFFIXES)}")
    return KERNELS[name]


def make_engine(cfg, params, replay, max_len, seqs, backend="xla", replay_tokens=None, scan_layers=None):
    attn, moe_be, mhc_be, router_be, linear_be = kernels_of(backend)
    suffixes = backend.split("+")[1:]
    opts = KernelOptions(fuse_rope="unfused-rope" not in suffixes,
                         prefill_indexer_kernel="xla-indexer" not in suffixes,
                         indexer_topk="kernel" if "kernel-topk" in suffixes else "auto")
    return Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg), config=EngineConfig(
        max_num_seqs=seqs, max_model_len=max_len, max_num_batched_tokens=2048, swa_bounded_replay=replay,
        swa_replay_tokens=replay_tokens or cfg.window_size, enable_prefix_caching=False, min_prefill_bucket=2048,
        attention_backend=attn, moe_backend=moe_be, mhc_backend=mhc_be, router_backend=router_be,
        linear_backend=linear_be, kernel_options=opts, scan_layers=scan_layers))


def with_schedule(cfg, name: str):
    """cfg at its widths with preset `name`'s layer schedule (roles, ratios, sources, Engram and DSpark layers)."""
    from dsv41 import config as C

    src = C.preset(name)
    kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    kw.update({k: getattr(src, k) for k in C._FLASH_SCHEDULE})
    return C.ModelConfig(**C._with_engram_rows(**kw))


def with_fp4_experts(params):
    """The routed experts quantized to the release's FP4 (what the grouped FP4 kernel reads); the rest stays."""
    q = jax.jit(quant.quantize_fp4_weight)
    layers = [{**lp, "ffn": {**lp["ffn"], "experts": {k: q(w) for k, w in lp["ffn"]["experts"].items()}}}
              for lp in params["layers"]]
    return {**params, "layers": layers}


def linear_flops(cfg, core, n: int, replay: bool) -> float:
    """FLOPs of the linears a prefill of n tokens runs (2 x weight elements x tokens; the routed experts count
    the n_activated chosen ones): layers up to the split layer on n tokens, the layers after it on n (exact) or
    on the last window of tokens (replay), the head on the last token. Attention and indexer scores are left
    out, so the roofline time it gives is a lower bound (the split layer counts whole for replay too)."""
    per_layer = []
    for lp in core["layers"]:
        rest = {**lp, "ffn": {k: v for k, v in lp["ffn"].items() if k != "experts"}}
        dense = sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(rest) if leaf.ndim >= 2)
        per_layer.append(dense + cfg.n_activated_experts * 3 * cfg.moe_inter_dim * cfg.dim)
    tokens = [n if i <= cfg.split_layer or not replay else min(n, cfg.window_size) for i in range(cfg.n_layers)]
    return 2.0 * (sum(t * w for t, w in zip(tokens, per_layer)) + cfg.vocab_size * cfg.dim)


def bench_prefill(cfg, params_of, backends, lengths, max_len, replays=(0, 128), scan_layers=None):
    """-> rows (backend, n, replay tokens (0: exact), first call s, warm s); params_of(backend) gives the weights
    it reads."""
    rows = []
    for be in backends:
        rng = np.random.default_rng(0)
        for replay in replays:
            eng = make_engine(cfg, params_of(be), replay > 0, max_len, 2, be, replay, scan_layers)
            for n in lengths:
                ids = list(rng.integers(3, cfg.vocab_size, n))
                sp = SamplingParams(max_tokens=1)
                t0 = time.perf_counter()
                eng.generate(ids, sp)
                first = time.perf_counter() - t0
                warm = timed(lambda: eng.generate(ids, sp), reps=3)
                rows.append((be, n, replay, first, warm))
                log.info("prefill %s n=%d replay=%s first=%.2fs warm=%.3fs", be, n, replay, first, warm)
            del eng
    return rows


def fake_decode_state(eng, B, ctx):
    """B running requests at position ctx with their pages assigned (the pool holds zeros: cost is the same)."""
    eng.running.clear()
    pages = iter(range(eng.layout.num_pages))
    for i in range(B):
        r = _Request(f"d{i}", [5] * ctx, SamplingParams(max_tokens=10**6, ignore_eos=True), None, float(i),
                     prefill_len=ctx)
        r.output, r.computed, r.rank, r.slot = [7], ctx, 0, i
        r.pages = [next(pages) for _ in range(-(-(ctx + 1) // eng.layout.page_tokens))]
        r.history = eng.hasher.initial_history(1)
        eng.running[r.id] = r


def weight_bytes(cfg, core):
    """-> (bytes of the weights every decode step reads: all but the routed experts and the embedding, of which
    a step reads one row a token; bytes of one routed expert), as stored in `core` (arrays or shapes)."""
    if "layers" in core:
        blocks = core["layers"]
    else:  # an engine's tree, grouped by run (`layer_runs.stack_params`): stacked dicts, or lists of layers
        blocks = [lp for g in core[layer_runs.RUNS_KEY] for lp in (g if isinstance(g, list) else [g])]
    experts = sum(P.tree_bytes(lp["ffn"]["experts"]) for lp in blocks)
    dense = P.tree_bytes(core) - experts - P.tree_bytes(core["embed"])
    return dense, experts / (cfg.n_layers * cfg.n_routed_experts)


def decode_bytes(cfg, B, ctx, dense_bytes, expert_bytes_per):
    """Bytes a decode step must touch at least: non-expert weights, the experts the batch selects (expected
    distinct experts of B*k uniform draws), the KV each sequence reads."""
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    distinct = E * (1 - (1 - k / E) ** B)
    experts = cfg.n_layers * distinct * expert_bytes_per
    swa = cfg.n_layers * 128 * 528 * B
    comp_layers = sum(1 for r in cfg.compress_ratios if r)
    idx_layers = len(cfg.index_source_layers)
    kv = B * (comp_layers * min(cfg.index_topk, ctx) * 288 + idx_layers * ctx * 68)
    return dense_bytes + experts + swa + kv


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--decode-ctx", type=int, default=4096)
    ap.add_argument("--decode-max-model-len", default="", help="decode engines of these sizes (default: the prefill's)")
    ap.add_argument("--preset", default="bench", help="tiny for a CPU smoke run")
    ap.add_argument("--backends", default="xla",
                    help="decode configurations to time: xla (plain XLA), attn (the KV-path kernels), "
                         "pallas (KV path + grouped FP4 expert GEMM), all (those + the fused mHC and router sites), "
                         "auto (the engine's defaults, as `dsv41 serve` runs: with --weights release the FP8 linear "
                         "kernel too), fp8 (auto + the FP8 linear kernel; needs --weights release), xla-linears "
                         "(auto with XLA's FP8 linears); suffixes change one option each: "
                         + "; ".join(f"+{k}: {v}" for k, v in SUFFIXES.items()))
    ap.add_argument("--prefill-backends", default="xla",
                    help="configurations (as --backends) of the prefill table, replay on and off for each")
    ap.add_argument("--weights", choices=["bf16", "release"], default="bf16",
                    help="bf16: dense weights, the routed experts in FP4 where the FP4 GEMM runs; release: the "
                         "release's stored formats everywhere (FP8 linears, FP4 experts), as a checkpoint loads")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--schedule", help="another preset's layer schedule at --preset's widths (flash: 40 layers)")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                    help="runs of layers in one scanned body, or every layer unrolled (EngineConfig.scan_layers; "
                         "default: the engine's)")
    ap.add_argument("--replay", choices=["both", "on", "off"], default="both",
                    help="prefill table: SWA bounded replay on and off (both), or one of them")
    ap.add_argument("--replay-tokens", default="",
                    help="more replay margins to time (--swa-replay-tokens, comma-separated) beside the window's")
    args = ap.parse_args()
    backends = [be for be in args.backends.split(",") if be]  # --backends "": the prefill table only
    pre_backends = [] if args.skip_prefill else args.prefill_backends.split(",")
    for be in backends + pre_backends:
        kernels_of(be)  # a bad name fails here, before minutes of set-up
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    cfg = preset(args.preset)
    if args.schedule:
        cfg = with_schedule(cfg, args.schedule)
    dev = jax.devices()[0]
    log.info("device %s", dev)
    ceil = ceilings(quick=dev.platform == "cpu")
    hbm, mxu = ceil["hbm_TBps"] * 1e12, ceil["mm_TFLOPs"] * 1e12
    log.info("HBM %.2f TB/s, bf16 matmul %.0f TFLOP/s", hbm / 1e12, mxu / 1e12)
    t = time.perf_counter()
    params = device_params(cfg) if args.weights == "bf16" else P.init_params(cfg, seed=0)
    jax.block_until_ready(params)
    log.info("params on device in %.1fs", time.perf_counter() - t)
    max_len = max(lengths) + 2048
    max_len = -(-max_len // 64) * 64

    fp4 = args.weights == "bf16" and any(kernels_of(be)[1] != "xla" for be in backends + pre_backends)
    fp4_params = with_fp4_experts(params) if fp4 else params

    def params_of(be):
        return fp4_params if kernels_of(be)[1] != "xla" else params

    W = cfg.window_size
    replays = {"both": (0, W), "on": (W,), "off": (0,)}[args.replay]
    margins = [int(x) for x in args.replay_tokens.split(",") if x and int(x) != W]
    replays += tuple(margins)
    pre = bench_prefill(cfg, params_of, pre_backends, lengths, max_len, replays, args.scan_layers)

    # the release's formats: wo_a ships as FP8 (convert.py, and our tree, keep it bf16)
    rel = model.strip_tables(P.abstract_params(cfg))[0]
    rel = {**rel, "layers": [{**lp, "attn": {**lp["attn"], "wo_a": jax.eval_shape(quant.quantize_fp8_weight,
                                                                                 lp["attn"]["wo_a"])}}
                             for lp in rel["layers"]]}
    rel_dense_b, rel_expert = weight_bytes(cfg, rel)
    dec = []
    sizes = [int(x) for x in args.decode_max_model_len.split(",") if x] or [max(max_len, args.decode_ctx + 128)]
    for be, B, size in [(be, B, n) for be in backends for B in batches for n in sizes]:
        eng = make_engine(cfg, params_of(be), True, size, max(batches), be, scan_layers=args.scan_layers)
        fake_decode_state(eng, B, args.decode_ctx)
        t0 = time.perf_counter()
        eng.step()
        compile_s = time.perf_counter() - t0
        # a step that waits for its own tokens, then (async scheduling) one that reads the previous step's
        step = [timed(eng.step, reps=10) for eng.async_scheduling in (False, True)]
        reqs = list(eng.running.values())
        b, s = eng.decode_inputs(reqs)

        def dev_only():
            eng.pool, _, tok = programs.run_full(eng.params, eng.pool, b, s, **eng.static)
            tok.block_until_ready()

        dev_t = timed(dev_only, reps=10)
        host_t = timed(lambda: eng.decode_inputs(reqs), reps=10)
        # the weights as the engine holds them
        read = decode_bytes(cfg, B, args.decode_ctx, *weight_bytes(cfg, eng.params))
        bytes_fp4 = decode_bytes(cfg, B, args.decode_ctx, rel_dense_b, rel_expert)
        dec.append((be, B, size, compile_s, step, dev_t, host_t, read, bytes_fp4))
        log.info("decode %s B=%d max_model_len=%d step sync/async %.2f/%.2f device %.2f host %.2f ms", be, B, size,
                 *(t * 1e3 for t in (*step, dev_t, host_t)))

    print(f"\n{dev.device_kind}, jax {jax.__version__}, bench preset: {cfg.n_layers} layers, {cfg.n_routed_experts} "
          f"experts, dim {cfg.dim}; measured HBM {hbm / 1e12:.2f} TB/s (scripts/timing.py's best), bf16 matmul "
          f"{mxu / 1e12:.0f} TFLOP/s\n")
    print("| kernels | prompt tokens | exact prefill s | replay prefill s | replay saves | exact: linear FLOPs / "
          "matmul rate s (of it) | replay: same (of it) | first call (compile) exact / replay s |\n" + "|---" * 8 + "|")
    core = model.strip_tables(params)[0]  # linear_flops counts its weight elements
    by = {(be, n, r): (f, w) for be, n, r, f, w in pre}
    nan = (math.nan, math.nan)  # a replay setting not run (--replay on|off)
    for be, n in [(be, n) for be in pre_backends for n in lengths]:
        e, r = by.get((be, n, 0), nan), by.get((be, n, W), nan)
        fe, fr = (linear_flops(cfg, core, n, rp) / mxu for rp in (False, True))
        print(f"| {be} | {n} | {e[1]:.3f} | {r[1]:.3f} | {100 * (1 - r[1] / e[1]):.0f}% | "
              f"{fe:.3f} ({100 * fe / e[1]:.0f}%) | {fr:.3f} ({100 * fr / r[1]:.0f}%) | {e[0]:.1f} / {r[0]:.1f} |")
    if margins:
        print(f"\n| kernels | prompt tokens | replay tokens | prefill s | vs {W} |\n|---|---|---|---|---|")
        for be, n, m in [(be, n, m) for be in pre_backends for n in lengths for m in (W, *margins)]:
            t = by.get((be, n, m), nan)[1]
            print(f"| {be} | {n} | {m} | {t:.3f} | {t / by.get((be, n, W), nan)[1]:.3f}x |")
    print(f"\n| kernels | batch | max_model_len ({args.decode_ctx}-token context) | engine step ms sync / async | "
          "device ms | host prep ms | roofline ms (weights as read) | of roofline | roofline ms (release FP8/FP4 "
          "weights) | first step (compile) s |\n" + "|---" * 10 + "|")
    for be, B, n, c, st, dv, ho, bb, bf in dec:
        print(f"| {be} | {B} | {n} | {st[0] * 1e3:.2f} / {st[1] * 1e3:.2f} | {dv * 1e3:.2f} | {ho * 1e3:.2f} | "
              f"{bb / hbm * 1e3:.2f} | {100 * bb / hbm / dv:.0f}% | {bf / hbm * 1e3:.2f} | {c:.1f} |")


if __name__ == "__main__":
    main()
