"""The `dsv41` command: generate, serve, bench, kv-budget, make-checkpoint, convert. It lives in `serving`
because it drives the engine; `dsv41` itself stays importable without it."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time

from serving import compilation_cache

log = logging.getLogger("dsv41")


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--checkpoint", help="release-format checkpoint directory (or an orbax directory from `convert`)")
    g.add_argument("--preset", default=None, help="built-in config with seeded random weights: tiny (default), bench")


def _engine_args(p: argparse.ArgumentParser) -> None:
    from serving.cli_serve import (add_engram_tables_arg, add_kernel_backend_args, add_multihost_args,
                                   add_parallel_args, add_speculative_arg)

    add_engram_tables_arg(p)
    compilation_cache.add_args(p)
    p.add_argument("--no-swa-bounded-replay", action="store_true",
                   help="run all layers on every prompt token (exact) instead of the decoder on the last 128")
    p.add_argument("--swa-replay-tokens", type=int, default=128,
                   help="prompt tokens the decoder layers run on under bounded replay (>= the window; docs/REPLAY.md)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one step (a prefill chunk plus the decode rows)")
    p.add_argument("--seed", type=int, default=0, help="weights seed for presets")
    add_kernel_backend_args(p, default="auto")
    add_parallel_args(p)
    add_multihost_args(p)
    add_speculative_arg(p)


def _given(**kw) -> dict:
    """The keyword arguments whose flag was given (the others keep their defaults)."""
    return {k: v for k, v in kw.items() if v is not None}


def build_engine(args: argparse.Namespace):
    from serving.cli_serve import speculative_config
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          swa_bounded_replay=not args.no_swa_bounded_replay,
                          swa_replay_tokens=args.swa_replay_tokens,
                          attention_backend=args.attention_backend, moe_backend=args.moe_backend,
                          mhc_backend=args.mhc_backend, router_backend=args.router_backend,
                          linear_backend=args.linear_backend, tensor_parallel_size=args.tensor_parallel_size or 1,
                          data_parallel_size=args.data_parallel_size or 1,
                          enable_expert_parallel=bool(args.enable_expert_parallel),
                          **_given(all2all_backend=args.all2all_backend),
                          speculative_config=speculative_config(args.speculative_config))
    if args.checkpoint:
        return Engine.from_checkpoint(args.checkpoint, engram_tables=args.engram_tables, config=config)
    return Engine.from_preset(args.preset or "tiny", seed=args.seed, config=config)


def cmd_generate(args: argparse.Namespace) -> int:
    from serving import multihost
    from serving.cli_serve import start_cluster

    t0 = time.perf_counter()
    cluster = start_cluster(args)
    return multihost.run(cluster, lambda: build_engine(args), lambda eng: _generate(eng, args, t0))


def _generate(eng, args: argparse.Namespace, t0: float) -> int:
    from dsv41 import chat
    from serving.engine.engine import SamplingParams

    tok = eng.tokenizer
    if args.chat:
        text = chat.encode_chat([{"role": "user", "content": args.prompt}], thinking=args.thinking)
        ids = tok.encode(text)
    else:
        ids = [tok.bos_id] + tok.encode(args.prompt)
    log.info("model ready in %.1f s (%s); prompt %d tokens; bounded replay %s", time.perf_counter() - t0,
             args.checkpoint or (args.preset or "tiny"), len(ids), "off" if args.no_swa_bounded_replay else "on")
    sp = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.sample_seed)
    t1 = time.perf_counter()
    out = eng.generate(ids, sp)
    dt = time.perf_counter() - t1
    text = tok.decode(out)
    if args.chat:
        parsed = chat.parse_completion(text, thinking=args.thinking)
        if parsed.reasoning_content:
            sys.stdout.write(f"[reasoning] {parsed.reasoning_content}\n")
        text = parsed.content
    sys.stdout.write(text + "\n")
    log.info("%d tokens in %.2f s (first call includes compilation)", len(out), dt)
    return 0


# Layouts `dsv41 kv-budget --plans` prints: (machine, GiB per GPU, layouts). A GB300 NVL72 rack is 18 trays of 4.
PLANS = (("8x H200", 141, ((8, 1, False), (1, 8, True), (4, 2, True), (4, 1, False))),
         ("GB300 NVL72", 288, ((4, 1, False), (1, 72, True), (1, 64, True), (4, 16, True))))


def cmd_kv_budget(args: argparse.Namespace) -> int:
    from dsv41.config import ModelConfig, preset
    from dsv41.sharding import Parallelism, ParallelismError
    from serving.engine import kv_pool

    cfg = ModelConfig.from_json(f"{args.checkpoint}/config.json") if args.checkpoint else preset(args.preset or "flash")
    tables = kv_pool.engram_bytes_per_device(cfg, 1)
    if args.plans:
        return _print_plans(cfg, args.max_model_len, args.device_feed)
    par = Parallelism(args.tensor_parallel_size or 1, args.data_parallel_size or 1, bool(args.enable_expert_parallel),
                      **_given(all2all=args.all2all_backend))
    try:
        feed = _feeds(cfg, par, args.gpu_memory_gb, args.device_feed)
        c = kv_pool.capacity(cfg, par, int(args.gpu_memory_gb * 2**30), args.max_model_len, device_feed=feed)
    except ParallelismError as e:
        log.error("%s", e)
        return 2
    rows = [("layout", f"TP{par.tensor} x DP{par.data}{' + EP' if par.expert else ''} ({par.devices} GPUs)"),
            ("global KV bytes / token (per data rank; replicated on its TP ranks)", f"{c.kv_bytes_per_token:.0f}"),
            ("SWA + compressor state / session", f"{c.slot_bytes / 2**20:.2f} MiB"),
            ("weights / GPU" + (" (+ the Engram tables' rows split over data ranks: decode fed on the GPUs)"
                                if feed else " (Engram tables in host memory)"),
             f"{c.weight_bytes_per_device / 2**30:.1f} GiB"),
            ("Engram tables (host)", f"{tables / 2**30:.1f} GiB"),
            ("GPU memory", f"{args.gpu_memory_gb} GiB x {par.devices}"),
            ("free for KV / GPU (10% reserve)", f"{max(0, c.free_bytes_per_device) / 2**30:.1f} GiB"),
            ("tokens of global KV / data rank", f"{c.tokens_per_rank:,}"),
            ("tokens of global KV in all", f"{c.tokens:,}"),
            ("longest context one rank holds", f"{c.longest_context:,}"),
            (f"sessions at {c.max_model_len:,} tokens (all ranks)", f"{c.sessions_per_rank() * par.data:,}")]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        sys.stdout.write(f"{k:<{w}}  {v}\n")
    if c.free_bytes_per_device <= 0:
        log.error("the weights alone do not fit: use more GPUs (--tensor-parallel-size, or --data-parallel-size "
                  "with --enable-expert-parallel) or more memory")
        return 1
    return 0


def _feeds(cfg, par, gpu_memory_gb: float, device_feed: bool | None) -> bool:
    """Whether `dsv41 serve` on these GPUs holds the Engram tables in their memory (its decode tokens fed on the
    device): as given, or the GPUs' default (`EngineConfig.feeds_on_device`)."""
    from serving.engine import kv_pool
    from serving.engine.config import EngineConfig

    return EngineConfig(device_feed=device_feed).feeds_on_device(
        "gpu", kv_pool.engram_bytes_per_device(cfg, par.data), int(gpu_memory_gb * 2**30))


def _print_plans(cfg, max_model_len: int | None, device_feed: bool | None) -> int:
    from dsv41.sharding import Parallelism, ParallelismError
    from serving.engine import kv_pool

    head = ("machine", "layout", "GPUs", "Engram tables", "weights/GPU", "KV/GPU", "tokens/rank", "tokens",
            "longest ctx", "sessions@len")
    out = [head]
    for machine, gib, layouts in PLANS:
        for tp, dp, ep in layouts:
            par = Parallelism(tp, dp, ep)
            name = f"TP{tp}" + (f" x DP{dp}" if dp > 1 else "") + (" + EP" if ep else "")
            try:
                feed = _feeds(cfg, par, gib, device_feed)
                c = kv_pool.capacity(cfg, par, gib * 2**30, max_model_len, device_feed=feed)
            except ParallelismError as e:
                out.append((machine, name, str(par.devices), "", f"cannot: {e}", "", "", "", "", ""))
                continue
            where = "GPU" if feed else "host"
            if c.free_bytes_per_device <= 0:
                out.append((machine, name, str(par.devices), where, f"{c.weight_bytes_per_device / 2**30:.1f} GiB",
                            "weights do not fit", "", "", "", ""))
                continue
            out.append((machine, name, str(par.devices), where, f"{c.weight_bytes_per_device / 2**30:.1f} GiB",
                        f"{c.free_bytes_per_device / 2**30:.1f} GiB", f"{c.tokens_per_rank:,}", f"{c.tokens:,}",
                        f"{c.longest_context:,}", f"{c.sessions_per_rank() * par.data:,} @ {c.max_model_len:,}"))
    widths = [max(len(r[i]) for r in out if len(r[i]) < 60) for i in range(len(head))]
    for r in out:
        sys.stdout.write("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() + "\n")
    sys.stdout.write("Engram tables on the GPU: their rows split over the data ranks and counted in weights/GPU, the "
                     "decode tokens fed on the device (serve's default where they take at most a quarter of a GPU; "
                     "--[no-]device-feed)\n")
    return 0


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from dsv41 import checkpoint
    from dsv41.config import preset
    from dsv41.tokenizer import BUILTIN_DIR

    cfg = preset(args.preset)
    tok_dir = BUILTIN_DIR if args.preset == "tiny" else None
    checkpoint.make_checkpoint(cfg, args.out_dir, seed=args.seed, n_shards=args.shards, tokenizer_dir=tok_dir,
                               dense_dtype=args.dense_dtype)
    log.info("wrote %s checkpoint to %s", args.preset, args.out_dir)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from dsv41 import checkpoint

    t = time.perf_counter()
    cfg, params = checkpoint.load_checkpoint(args.checkpoint)
    t1 = time.perf_counter()
    checkpoint.save_orbax(params, cfg, args.out_dir)
    for name in checkpoint.TOKENIZER_FILES:  # the engine reads its tokenizer from the checkpoint directory
        if os.path.exists(os.path.join(args.checkpoint, name)):
            shutil.copyfile(os.path.join(args.checkpoint, name), os.path.join(args.out_dir, name))
    log.info("loaded in %.1f s, saved orbax checkpoint to %s in %.1f s", t1 - t, args.out_dir,
             time.perf_counter() - t1)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU found" on every start
    ap = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash inference and serving in JAX")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat encoding")
    g.add_argument("--thinking", action="store_true", help="with --chat: thinking mode")
    _model_args(g)
    _engine_args(g)
    g.set_defaults(fn=cmd_generate)

    k = sub.add_parser("kv-budget", help="bytes of KV per token and how many tokens/sessions fit")
    _model_args(k)
    k.add_argument("--gpu-memory-gb", type=float, default=141.0)
    from serving.cli_serve import add_parallel_args

    add_parallel_args(k)
    k.add_argument("--max-model-len", type=int, default=None)
    k.add_argument("--plans", action="store_true",
                   help="the standard layouts of an 8x H200 host and a GB300 NVL72 rack, one line each")
    k.add_argument("--device-feed", action=argparse.BooleanOptionalAction, default=None,
                   help="count the Engram tables in GPU memory, their rows split over the data ranks (`dsv41 serve "
                        "--device-feed`); --no-device-feed: in host memory only (`serve --no-device-feed`). "
                        "Default: as serve on GPUs, in GPU memory where they take at most a quarter of it")
    k.set_defaults(fn=cmd_kv_budget)

    m = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the release format")
    m.add_argument("out_dir")
    m.add_argument("--preset", default="tiny")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shards", type=int, default=4)
    m.add_argument("--dense-dtype", choices=["bfloat16", "float32"], default=None,
                   help="write dequantized weights (for BF16/F32-only readers)")
    m.set_defaults(fn=cmd_make_checkpoint)

    c = sub.add_parser("convert", help="save a loaded checkpoint (still quantized) as orbax for fast restarts")
    c.add_argument("checkpoint")
    c.add_argument("out_dir")
    c.set_defaults(fn=cmd_convert)

    from serving import cli_serve

    s = sub.add_parser("serve", help="OpenAI-compatible server")
    cli_serve.add_serve_args(s)
    s.set_defaults(fn=cli_serve.run_serve)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser("serve", help="agentic multi-turn load against a running server")
    cli_serve.add_bench_args(bs)
    bs.set_defaults(fn=cli_serve.run_bench)

    args = ap.parse_args(argv)
    compilation_cache.configure(compilation_cache.dir_from_args(args))
    try:
        return int(args.fn(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
