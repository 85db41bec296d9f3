"""Engine benchmarks on one GPU with the `bench` preset (Flash's per-layer widths, 8 layers, 64 experts): prefill
with SWA bounded replay on vs off against the matmul rate, decode step time against the HBM roofline, host
overhead, compile times (ceilings: scripts/timing.py). Prints markdown tables for docs/PERFORMANCE.md.

    PYTHONPATH=. python3 scripts/bench_engine.py [--lengths 1024,4096,16384] [--batches 1,8,64]
        [--decode-max-model-len 16384,65536]   (a decode at --decode-ctx in engines of each size)
        [--prefill-max-model-len 18432,67584]  (each prefill in engines of each size: the same time, ideally)

What each prefill bucket below a chunk costs (`dsv41 serve` compiles one program a bucket, 16 tokens up; fewer
buckets, fewer programs to compile at start-up, more padding), against every prompt padded to 128 tokens:

    PYTHONPATH=. python3 scripts/bench_engine.py --backends "" --prefill-backends auto --weights release \
        --replay on --lengths 16,32,64,128,256,512 --min-prefill-bucket 16   (then --min-prefill-bucket 128)

Scanned runs of layers (dsv41/layer_runs.py; the bench schedule's runs are all one layer) against every layer
unrolled, at Flash's 40-layer schedule (the release's weight formats, 16 experts a layer: ~24 GB, which the last
decode engine takes over from the script, so that they are held once and fit an 80 GB card):

    PYTHONPATH=. python3 scripts/bench_engine.py --schedule flash --experts 16 --weights release --backends auto \
        --batches 1,64 --skip-prefill [--scan-layers|--no-scan-layers]

Random weights made on the device: dense bf16, the routed experts in FP4 where the FP4 expert GEMM runs.
"""

from __future__ import annotations

import logging
import math
import time

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import numpy as np

from dsv41 import layer_runs, model, quant
from dsv41 import params as P
from serving.engine.engine import SamplingParams
from timing import KERNEL_NAMES, SUFFIXES, device_params, fake_decode_state, kernels_of, make_engine, with_fp4_experts
from timing import median_wall_s as timed

log = logging.getLogger("bench_engine")


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


def bench_prefill(cfg, params_of, backends, lengths, sizes, replays=(0, 128), scan_layers=None,
                  min_bucket=2048):
    """-> rows (backend, engine size (max_model_len), n, replay tokens (0: exact), first call s, warm s);
    params_of(backend) gives the weights it reads; a prompt shorter than min_bucket is padded to it."""
    rows = []
    for be, size in [(be, size) for be in backends for size in sizes]:
        for replay in replays:
            rng = np.random.default_rng(0)  # the same prompts in every engine
            eng = make_engine(cfg, params_of(be), replay > 0, size, 2, be, replay, min_bucket,
                              scan_layers=scan_layers)
            for n in lengths:
                ids = list(rng.integers(3, cfg.vocab_size, n))
                sp = SamplingParams(max_tokens=1)
                first, warm = timed(lambda: eng.generate(ids, sp), reps=1), timed(lambda: eng.generate(ids, sp), reps=3)
                rows.append((be, size, n, replay, first, warm))
                log.info("prefill %s max_model_len=%d n=%d replay=%s first=%.2fs warm=%.3fs", be, size, n, replay,
                         first, warm)
            del eng
    return rows


def weight_bytes(cfg, core):
    """-> (bytes of the weights every decode step reads: all but the routed experts and the embedding, of which
    a step reads one row a token; bytes of one routed expert), as stored in `core` (arrays or shapes)."""
    if "layers" in core:
        blocks = core["layers"]
    else:  # an engine's tree, grouped by run (`layer_runs.stack_params`)
        blocks = [lp for g in core[layer_runs.RUNS_KEY] for lp in layer_runs.trees_of(g)]
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
    ap = timing.engine_args(__doc__, batches="1,8,64")
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--decode-max-model-len", default="", help="decode engines of these sizes (default: the prefill's)")
    ap.add_argument("--prefill-max-model-len", default="",
                    help="prefill engines of these sizes (default: the longest length + 2048): a prefill's time should "
                         "not depend on it")
    ap.add_argument("--backends", default="xla",
                    help="decode configurations to time: " + "; ".join(f"{k} ({v})" for k, v in KERNEL_NAMES.items())
                    + "; suffixes change one option each: " + "; ".join(f"+{k}: {v}" for k, v in SUFFIXES.items()))
    ap.add_argument("--prefill-backends", default="xla",
                    help="configurations (as --backends) of the prefill table, replay on and off for each")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--min-prefill-bucket", type=int, default=2048,
                    help="prefill: a shorter prompt is padded to this many tokens (serve's default: 16); with short "
                         "--lengths, each bucket's program timed")
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
    cfg = timing.model_config(args)
    dev = jax.devices()[0]
    ceil = timing.ceilings(quick=True) if dev.platform == "cpu" else timing.bench_ceilings()
    hbm, mxu = ceil["hbm_TBps"] * 1e12, ceil["mm_TFLOPs"] * 1e12
    t = time.perf_counter()
    params = device_params(cfg) if args.weights == "bf16" else P.init_params(cfg, seed=0)
    jax.block_until_ready(params)
    log.info("params on device in %.1fs", time.perf_counter() - t)
    max_len = -(-(max(lengths) + 2048) // 64) * 64

    fp4 = args.weights == "bf16" and any(kernels_of(be)[1] != "xla" for be in backends + pre_backends)
    fp4_params = with_fp4_experts(params) if fp4 else params

    def params_of(be):
        return fp4_params if kernels_of(be)[1] != "xla" else params

    W = cfg.window_size
    replays = {"both": (0, W), "on": (W,), "off": (0,)}[args.replay]
    margins = [int(x) for x in args.replay_tokens.split(",") if x and int(x) != W]
    replays += tuple(margins)
    pre_sizes = [int(x) for x in args.prefill_max_model_len.split(",") if x] or [max_len]
    if min(pre_sizes) < max(lengths) + 1:
        ap.error(f"--prefill-max-model-len {min(pre_sizes)} cannot hold a {max(lengths)}-token prompt and the token "
                 f"it generates: give sizes above {max(lengths)}")
    pre = bench_prefill(cfg, params_of, pre_backends, lengths, pre_sizes, replays, args.scan_layers,
                        args.min_prefill_bucket)

    # the release's formats: wo_a ships as FP8 (convert.py, and our tree, keep it bf16)
    rel = model.strip_tables(P.abstract_params(cfg))[0]
    rel = {**rel, "layers": [{**lp, "attn": {**lp["attn"], "wo_a": jax.eval_shape(quant.quantize_fp8_weight,
                                                                                 lp["attn"]["wo_a"])}}
                             for lp in rel["layers"]]}
    rel_dense_b, rel_expert = weight_bytes(cfg, rel)
    dec = []
    sizes = [int(x) for x in args.decode_max_model_len.split(",") if x] or [max(max_len, args.decode_ctx + 128)]
    # linear_flops reads the weights' shapes only: kept, so the weights themselves can go to the last engine
    core = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.strip_tables(params)[0])
    jobs = [(be, n) for be in backends for n in sizes]
    for i, (be, size) in enumerate(jobs):
        # one engine a configuration, every batch on it; the previous engine's weights freed before the next is
        # built, and the last one takes the script's weights over (held once: Flash's 40 layers fit an H100)
        eng = None
        weights, own = params_of(be), i == len(jobs) - 1
        if own:
            params = fp4_params = None
        eng = make_engine(cfg, weights, True, size, max(batches), be, scan_layers=args.scan_layers,
                          own_params=own)
        del weights
        for B in batches:
            eng.async_scheduling = False  # the previous batch's last (async) step is read and dropped by the next
            fake_decode_state(eng, B, args.decode_ctx, args.temperature)
            compile_s = timed(eng.step, reps=1)
            # a step that waits for its own tokens, then (async scheduling) one that reads the previous step's
            step = [timed(eng.step, reps=10) for eng.async_scheduling in (False, True)]
            reqs = list(eng.running.values())
            b, s = eng.decode_inputs(reqs)

            def dev_only():
                eng.run_decode(b)[1].block_until_ready()

            dev_t = timed(dev_only, reps=10)
            host_t = timed(lambda: eng.decode_inputs(reqs), reps=10)
            # the weights as the engine holds them
            read = decode_bytes(cfg, B, args.decode_ctx, *weight_bytes(cfg, eng.params))
            bytes_fp4 = decode_bytes(cfg, B, args.decode_ctx, rel_dense_b, rel_expert)
            dec.append((be, B, size, compile_s, step, dev_t, host_t, read, bytes_fp4))
            log.info("decode %s B=%d max_model_len=%d step sync/async %.2f/%.2f device %.2f host %.2f ms", be, B,
                     size, *(t * 1e3 for t in (*step, dev_t, host_t)))

    print(f"\n{dev.device_kind}, jax {jax.__version__}, {args.preset} preset: {cfg.n_layers} layers, "
          f"{cfg.n_routed_experts} experts, dim {cfg.dim}; measured HBM {hbm / 1e12:.2f} TB/s (scripts/timing.py's "
          f"best), bf16 matmul {mxu / 1e12:.0f} TFLOP/s\n")
    print("| kernels | max_model_len | prompt tokens | exact prefill s | replay prefill s | replay saves | exact: "
          "linear FLOPs / matmul rate s (of it) | replay: same (of it) | first call (compile) exact / replay s |\n"
          + "|---" * 9 + "|")
    by = {(be, z, n, r): (f, w) for be, z, n, r, f, w in pre}
    nan = (math.nan, math.nan)  # a replay setting not run (--replay on|off)
    for be, z, n in [(be, z, n) for be in pre_backends for z in pre_sizes for n in lengths]:
        e, r = by.get((be, z, n, 0), nan), by.get((be, z, n, W), nan)
        fe, fr = (linear_flops(cfg, core, n, rp) / mxu for rp in (False, True))
        print(f"| {be} | {z} | {n} | {e[1]:.3f} | {r[1]:.3f} | {100 * (1 - r[1] / e[1]):.0f}% | "
              f"{fe:.3f} ({100 * fe / e[1]:.0f}%) | {fr:.3f} ({100 * fr / r[1]:.0f}%) | {e[0]:.1f} / {r[0]:.1f} |")
    if margins:
        print(f"\n| kernels | max_model_len | prompt tokens | replay tokens | prefill s | vs {W} |\n"
              "|---|---|---|---|---|---|")
        for be, z, n, m in [(be, z, n, m) for be in pre_backends for z in pre_sizes for n in lengths
                            for m in (W, *margins)]:
            t = by.get((be, z, n, m), nan)[1]
            print(f"| {be} | {z} | {n} | {m} | {t:.3f} | {t / by.get((be, z, n, W), nan)[1]:.3f}x |")
    print(f"\n| kernels | batch | max_model_len ({args.decode_ctx}-token context) | engine step ms sync / async | "
          "device ms | host prep ms | roofline ms (weights as read) | of roofline | roofline ms (release FP8/FP4 "
          "weights) | first step (compile) s |\n" + "|---" * 10 + "|")
    for be, B, n, c, st, dv, ho, bb, bf in dec:
        print(f"| {be} | {B} | {n} | {st[0] * 1e3:.2f} / {st[1] * 1e3:.2f} | {dv * 1e3:.2f} | {ho * 1e3:.2f} | "
              f"{bb / hbm * 1e3:.2f} | {100 * bb / hbm / dv:.0f}% | {bf / hbm * 1e3:.2f} | {c:.1f} |")
    timing.write_json(args.out, "bench_engine.json", {"args": vars(args), "ceilings": ceil, "prefill": pre,
                                                       "decode": dec})


if __name__ == "__main__":
    main()
