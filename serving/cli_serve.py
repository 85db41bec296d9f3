"""`dsv41 serve` and `dsv41 bench serve`: argument definitions and entry points (flags named as vLLM names them).

    dsv41 serve --preset tiny --port 8000
    dsv41 serve --checkpoint /ckpt/flash --max-model-len 131072 --max-num-seqs 64
    dsv41 bench serve --port 8000 --max-concurrency 1,4,16 --num-turns 4 --result-dir out/bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any

from serving import compilation_cache

log = logging.getLogger(__name__)

DEFAULT_PRESET = "tiny"


def _ensure_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---- serve ---------------------------------------------------------------------------------------------------


def add_engram_tables_arg(g) -> None:
    """--engram-tables, shared by `dsv41 serve` and `dsv41 generate`."""
    g.add_argument("--engram-tables", choices=["ram", "mmap"], default="ram",
                   help="with --checkpoint: read the Engram tables into host memory at load (ram, the default: "
                        "no request waits on the disk for its rows) or leave them memory-mapped (mmap: less host "
                        "memory; a row's first gather reads its page from disk)")


def add_kernel_backend_args(g, default: str | None) -> None:
    """The kernel-backend flags, shared by `dsv41 serve` (default None: the engine's) and `dsv41 generate`."""
    opts = {"choices": ["auto", "xla", "pallas"], "default": default}
    g.add_argument("--attention-backend", **opts,
                   help="KV path (prefill and decode attention; decode KV writes and indexer top-k): the fused "
                        "Mosaic GPU kernels or the XLA path (auto, the default: the kernels on a GPU)")
    g.add_argument("--moe-backend", **opts,
                   help="routed experts: the grouped FP4 Mosaic GPU kernel or XLA's ragged_dot on dequantized "
                        "weights (auto, the default: the kernel on a GPU with FP4 experts)")
    g.add_argument("--mhc-backend", **opts,
                   help="mHC sites (stream coefficients, collapse, norm, expand): one fused Mosaic GPU kernel per "
                        "site or XLA (auto, the default: the kernel on a GPU with bf16 activations, in calls of up "
                        "to 64 tokens (decode batches); XLA in larger ones, where it was faster on the H200)")
    g.add_argument("--router-backend", **opts,
                   help="MoE router (gate GEMM, sqrt-softplus, top-k, renorm, expert permutation): the fused Mosaic "
                        "GPU kernels or XLA (auto, the default: the kernels on a GPU where the expert count allows "
                        "them, at every size; docs/KERNELS_ROUTER.md)")
    g.add_argument("--linear-backend", **opts,
                   help="FP8 linears (attention projections with the grouped wo_a, shared expert, Engram) at "
                        "decode: the FP8 Mosaic GPU kernel, which reads each weight byte once, or XLA's dequantize + "
                        "GEMM (auto, the default: the kernel on a GPU with FP8 linears (a release checkpoint) and "
                        "bf16 activations; it took the batch-1 decode step on the H200 from 6.5 to 4.4 ms. Either "
                        "repeats bit for bit; they differ from each other by rounding: docs/PERFORMANCE.md)")


def add_parallel_args(g) -> None:
    """vLLM's parallelism flags (`EngineConfig.parallelism`; the layouts are `dsv41.sharding`'s)."""
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="devices that split heads, widths and the vocabulary (default 1)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="data-parallel ranks, each running its own requests on its own KV pool (default 1)")
    g.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="split the routed experts over every device (needs --data-parallel-size > 1)")
    g.add_argument("--all2all-backend", default=None,
                   help="how tokens reach the ranks of their experts under --enable-expert-parallel: "
                        "allgather_reducescatter (the default: every rank gathers every token, partial sums "
                        "reduce-scattered back) or ragged_all_to_all (each token only to the ranks of its experts "
                        "and back: fewer bytes as the rank count grows; docs/ARCHITECTURE.md)")


def add_multihost_args(g) -> None:
    """One engine over several processes (hosts) with jax.distributed (`serving.multihost`). Without these flags
    a cluster environment (JAX_COORDINATOR_ADDRESS, a Slurm or Open MPI job of several tasks) still starts one."""
    g.add_argument("--num-processes", type=int, default=None,
                   help="processes (hosts) that run the engine together; every one runs this command with the same "
                        "flags and its own --process-id; the mesh spans all their devices")
    g.add_argument("--process-id", type=int, default=None,
                   help="this process's index in [0, --num-processes); process 0 serves HTTP and drives the others")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's host and a free port for jax.distributed's coordinator; the engine's side "
                        "channel uses the next port")


def start_cluster(args: argparse.Namespace) -> Any:
    """jax.distributed.initialize from the multi-host flags (or the cluster environment), before anything touches a
    device. -> the `serving.multihost.Cluster`, or None for one process."""
    from serving import multihost

    n, pid, addr = args.num_processes, args.process_id, args.coordinator_address
    if n is None:
        if pid is not None or addr is not None:
            raise SystemExit("--process-id / --coordinator-address need --num-processes; give all three")
        return multihost.initialize(None)
    if n < 1 or pid is None or addr is None or not 0 <= pid < n or ":" not in addr:
        raise SystemExit(f"--num-processes {n} --process-id {pid} --coordinator-address {addr}: give the process "
                         f"count, this process's id in [0, {n}) and process 0's HOST:PORT")
    return multihost.initialize(multihost.Cluster(num_processes=n, process_id=pid, coordinator_address=addr))


def add_speculative_arg(g) -> None:
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s flag: \'{"method": "dspark", "num_speculative_tokens": 5}\' '
                        "(the release's DSpark drafter; greedy tokens unchanged, sampling exact by rejection sampling). "
                        '"confidence_threshold": 0.5 verifies only the drafts whose cumulative confidence (DSpark\'s '
                        "confidence head) reaches it; "
                        '"greedy_program": the host picks a step\'s sampling branch (all-greedy steps run a program '
                        "without sampling: one more program a decode batch bucket; no host round trip in the step; "
                        "default: on a GPU only); "
                        '"forced_acceptance": true takes every draft, for benchmarks only (wrong outputs)')


def speculative_config(text: str | None):
    """--speculative-config's JSON -> `SpeculativeConfig` (None: off); a bad value exits naming it."""
    if text is None:
        return None
    from serving.engine.config import SpeculativeConfig
    from serving.engine.errors import EngineError

    try:
        return SpeculativeConfig.from_json(text)
    except EngineError as e:
        raise SystemExit(str(e)) from None


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("model")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint directory (the release's format); default: --preset")
    src.add_argument("--preset", help="built-in config with random weights: tiny (default), bench, flash")
    g.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint directory's "
                                               "name or the preset name)")
    add_engram_tables_arg(g)
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, help="longest prompt + output, in tokens (default: the engine's)")
    g.add_argument("--max-num-seqs", type=int, help="most requests in one running batch")
    g.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step (prefill chunks + decodes)")
    g.add_argument("--no-swa-bounded-replay", dest="swa_bounded_replay", action="store_false", default=None,
                   help="exact prefill: run every layer on every prompt token instead of the decoder layers on "
                        "the last 128 (SWA bounded replay); also turns prefix caching off unless enabled")
    g.add_argument("--swa-replay-tokens", type=int,
                   help="prompt tokens the decoder layers run on under SWA bounded replay: at least the window "
                        "(128), at most --max-num-batched-tokens (default: the engine's, 128; docs/REPLAY.md)")
    add_kernel_backend_args(g, default=None)
    g.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="compile one body for a run of layers of one kind, their weights stacked (compile time "
                        "~flat in the layer count); default: on the XLA path, off where the GPU kernels run")
    g.add_argument("--split-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="run a decode step as two programs cut at the replay split layer, which compile side by "
                        "side at start-up (default: on a GPU, off on the CPU)")
    g.add_argument("--block-size", dest="page_tokens", type=int, help="tokens per KV page (default: the engine's)")
    g.add_argument("--num-gpu-blocks-override", dest="num_pages", type=int,
                   help="KV pool pages (default: enough for max-num-seqs sequences of max-model-len)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="keep full KV pages of finished requests for later prompts with the same prefix "
                        "(default: the engine's)")
    g.add_argument("--max-waiting", type=int, help="waiting-queue bound; beyond it requests get 503 + Retry-After")
    g.add_argument("--min-prefill-bucket", type=int,
                   help="smallest padded prefill chunk; chunks pad to powers of two from here up to "
                        "--max-num-batched-tokens (equal to it: one prefill program, more padding; default: 16 "
                        "on a GPU, the chunk on the CPU)")
    g.add_argument("--min-decode-bucket", type=int,
                   help="smallest padded decode batch; batches pad to it times powers of two up to "
                        "--max-num-seqs (equal to it: one decode program; default: 1 on a GPU, --max-num-seqs "
                        "on the CPU)")
    g.add_argument("--max-prefill-rows", type=int,
                   help="short prompts share a prefill call: up to this many a data rank, each finishing within "
                        "--max-num-batched-tokens / this many tokens, in one program of that shape (e.g. 4; default "
                        "1: one prompt a rank a call; off where that share is below --min-prefill-bucket)")
    add_parallel_args(g)
    add_multihost_args(g)
    add_speculative_arg(g)
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="one program shape for every step (prefill at the chunk, decode at --max-num-seqs): a request's tokens and logits are the same bits alone, in "
                        "any batch or after a prefix hit; more padding (overrides the --min-* buckets)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="run each step's programs while the server streams the previous step's tokens (default "
                        "off; speculative decoding steps stay synchronous unless --device-feed); the tokens are the "
                        "same either way")
    g.add_argument("--device-feed", action=argparse.BooleanOptionalAction, default=None,
                   help="dispatch each decode step before reading the previous step's tokens, which the program "
                        "takes on the device with their Engram rows (the Engram tables then also live in device "
                        "memory, their rows split over the data ranks: 5.9 GiB for the bench preset; `dsv41 "
                        "kv-budget` counts them). Implies --async-scheduling. With --speculative-config each step's "
                        "chunk (bonus token, drafts) is built on the device from the step before (default: on with "
                        "a GPU, unless the tables would take over a quarter of a GPU's memory; off on CPU)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every program shape before serving, so no request waits for a compile; the port "
                        "opens first and /health answers 503 with the progress until warm-up ends (default: on "
                        "with a GPU, off on CPU; fewer buckets = shorter warm-up)")
    g.add_argument("--serve-during-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="with --warmup, take requests once the programs that cover every step (the largest "
                        "prefill chunk, the replay decoder, the largest decode batch) are ready; the others compile "
                        "in the background, and until each is ready short prompts and small batches pad to those "
                        "(default: on; off: /health answers 503 until every program is ready)")
    g.add_argument("--seed", type=int, help="seed of the random weights of --preset")
    compilation_cache.add_args(g)
    g.add_argument("--program-store", action=argparse.BooleanOptionalAction, default=None,
                   help="keep warm-up's compiled programs beside the compilation cache, so the next start loads "
                        "them without tracing (default: on)")
    g.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="processes that compile warm-up's programs into the program store while the weights load "
                        "(0: the server's own process compiles them; default: half the host's cores, at most 8, "
                        "where the server warms up one GPU with the program store, else 0; on a mesh on request)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-queue-wait", type=float, default=None, metavar="SECONDS",
                   help="a request still in the engine's waiting queue after this long is dropped with 503 + "
                        "Retry-After, so a client under overload learns it and retries (default: no limit)")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log one line per request: method, path, status, prompt/output tokens, TTFT, total time "
                        "(no prompt text; logger dsv41.access)")
    g.add_argument("--demo", action="store_true",
                   help="start on a free port, send one chat request over HTTP, print request and answer, stop")
    g = parser.add_argument_group("images (image_url content parts; a model with a vision_config)")
    g.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="HOST",
                   help="hosts the server may fetch http(s) image URLs from (default: none; data: URLs only)")
    g.add_argument("--max-image-bytes", type=int, help="largest encoded image, in bytes (default: 20 MiB)")
    g.add_argument("--max-images-per-request", type=int, help="(default: 8)")
    g.add_argument("--max-image-pixels", type=int,
                   help="largest image, width x height, refused before it is decoded (default: 8192 x 8192)")
    return parser


def media_config(args: argparse.Namespace):
    """The image flags as a serving.media.MediaConfig (unset ones keep its defaults)."""
    from serving.media import MediaConfig

    kw = {}
    for flag, field in (("max_image_bytes", "max_image_bytes"), ("max_images_per_request", "max_images"),
                        ("max_image_pixels", "max_image_pixels")):
        v = getattr(args, flag, None)
        if v is not None:
            if v < 1:
                raise SystemExit(f"--{flag.replace('_', '-')} {v}: give a positive integer")
            kw[field] = v
    return MediaConfig(allowed_media_domains=tuple(getattr(args, "allowed_media_domains", ()) or ()), **kw)


# Engine keyword argument -> the flag that sets it.
_ENGINE_FLAGS = {"max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
                 "max_num_batched_tokens": "--max-num-batched-tokens",
                 "swa_bounded_replay": "--no-swa-bounded-replay", "swa_replay_tokens": "--swa-replay-tokens",
                 "attention_backend": "--attention-backend", "scan_layers": "--[no-]scan-layers",
                 "split_decode": "--[no-]split-decode",
                 "moe_backend": "--moe-backend", "mhc_backend": "--mhc-backend",
                 "router_backend": "--router-backend", "linear_backend": "--linear-backend",
                 "page_tokens": "--block-size", "num_pages": "--num-gpu-blocks-override",
                 "enable_prefix_caching": "--[no-]enable-prefix-caching", "max_waiting": "--max-waiting",
                 "min_prefill_bucket": "--min-prefill-bucket", "max_prefill_rows": "--max-prefill-rows",
                 "min_decode_bucket": "--min-decode-bucket", "batch_invariant": "--batch-invariant",
                 "async_scheduling": "--[no-]async-scheduling", "device_feed": "--[no-]device-feed",
                 "tensor_parallel_size": "--tensor-parallel-size", "data_parallel_size": "--data-parallel-size",
                 "enable_expert_parallel": "--enable-expert-parallel", "all2all_backend": "--all2all-backend",
                 "speculative_config": "--speculative-config", "program_store": "--[no-]program-store"}


def engine_kwargs(args: argparse.Namespace, accepted: set[str] | None = None) -> dict[str, Any]:
    """The engine flags that were given, as EngineConfig fields (unset ones keep the engine's defaults).
    accepted: the field names the engine takes; a given flag outside them is an error that names it."""
    kw = {n: getattr(args, n) for n in _ENGINE_FLAGS if getattr(args, n, None) is not None}
    for n, v in kw.items():
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise SystemExit(f"{_ENGINE_FLAGS[n]} {v}: give a positive integer")
    if "speculative_config" in kw:
        kw["speculative_config"] = speculative_config(kw["speculative_config"])
    if accepted is not None:
        unknown = sorted(n for n in kw if n not in accepted)
        if unknown:
            raise SystemExit(f"{', '.join(_ENGINE_FLAGS[n] for n in unknown)}: not supported by this engine build "
                             f"(EngineConfig takes {sorted(accepted & set(_ENGINE_FLAGS))}); leave the flag out")
    return kw


def build_engine(args: argparse.Namespace) -> Any:
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    kw = engine_kwargs(args, EngineConfig.field_names())
    config = EngineConfig(**kw, compile_workers=compile_workers(args, kw))
    if args.checkpoint:
        if not os.path.isdir(args.checkpoint):
            raise SystemExit(f"--checkpoint {args.checkpoint}: not a directory; give the checkpoint's folder")
        log.info("loading checkpoint %s (%s)", args.checkpoint, config)
        return Engine.from_checkpoint(args.checkpoint, engram_tables=args.engram_tables, config=config)
    seed = {} if args.seed is None else {"seed": args.seed}
    log.info("building preset %r with random weights (%s)", args.preset or DEFAULT_PRESET, config)
    return Engine.from_preset(args.preset or DEFAULT_PRESET, config=config, **seed)


def warmup_wanted(args: argparse.Namespace) -> bool:
    """Whether `dsv41 serve` warms up: --warmup / --no-warmup, else with a GPU."""
    import jax

    given = getattr(args, "warmup", None)
    return given if given is not None else jax.default_backend() == "gpu"


def compile_workers(args: argparse.Namespace, engine_kw: dict[str, Any]) -> int:
    """--compile-workers, or its default: `precompile.default_count` where the server warms up on one device with
    the program store, else 0."""
    from serving.engine import precompile

    n = getattr(args, "compile_workers", None)
    if n is not None:
        if n < 0:
            raise SystemExit(f"--compile-workers {n}: give 0 (compile in the server's process) or more")
        return n
    import jax

    # a mesh's workers each open every device of the mesh: on request only until timed on several GPUs
    one_device = engine_kw.get("tensor_parallel_size", 1) * engine_kw.get("data_parallel_size", 1) == 1
    if not (warmup_wanted(args) and one_device and jax.process_count() == 1
            and engine_kw.get("program_store", True)):
        return 0
    return precompile.default_count(jax.default_backend())


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.checkpoint:
        return os.path.basename(os.path.normpath(args.checkpoint))
    return args.preset or DEFAULT_PRESET


def check_server_args(args: argparse.Namespace) -> None:
    if args.max_queue_wait is not None and not args.max_queue_wait > 0:
        raise SystemExit(f"--max-queue-wait {args.max_queue_wait}: give a positive number of seconds, or leave "
                         "it out for no limit")


def _serve_forever(engine: Any, args: argparse.Namespace, warmup: bool = False) -> None:
    """uvicorn in this (the main) thread: on SIGINT / SIGTERM it stops accepting, lets the requests in flight
    finish (drain), then the app's lifespan stops the engine thread. With `warmup` the engine thread compiles
    every program first while the port is already open (/health: 503 with the progress until it is done)."""
    import uvicorn

    from serving.api import bind, create_app, uvicorn_config
    from serving.async_engine import AsyncEngine
    from serving.metrics import ServingMetrics

    name = served_model_name(args)
    metrics = ServingMetrics(name)
    aeng = AsyncEngine(engine, metrics=metrics, max_queue_wait_s=args.max_queue_wait, warmup=warmup,
                       staged_warmup=warmup and getattr(args, "serve_during_warmup", False))
    on_lost = getattr(engine, "on_lost", None)  # several processes: a lost one fails every request with 503
    if on_lost is not None:
        on_lost.callbacks.append(aeng.fail)
    logging.getLogger("dsv41.access").setLevel(logging.INFO if args.access_log else logging.WARNING)
    sock = bind(args.host, args.port)  # OSError here: the caller names the port
    app = create_app(aeng, model_name=name, metrics=metrics, media=media_config(args))
    server = uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port))
    log.info("listening on http://%s:%d (model %r, max_model_len %d)%s", args.host, args.port, name,
             engine.max_model_len, "; warming up: /health answers 503 with the progress until ready" if warmup
             else "")
    server.run(sockets=[sock])


def run_demo(engine, args: argparse.Namespace) -> int:
    """One served request, end to end: what a new user sees first."""
    import urllib.request

    from serving.api import BackgroundServer

    body = {"model": served_model_name(args), "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with BackgroundServer(engine, model_name=served_model_name(args)) as srv:
        url = srv.base_url + "/v1/chat/completions"
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            answer = json.loads(resp.read())
    sys.stdout.write(f"POST {url}\n{json.dumps(body, indent=1)}\n-> {json.dumps(answer, indent=1)}\n")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    _ensure_logging()
    check_server_args(args)
    from serving import multihost

    cluster = start_cluster(args)
    return multihost.run(cluster, lambda: build_engine(args), lambda engine: _run_serve(engine, args))


def _run_serve(engine: Any, args: argparse.Namespace) -> int:
    warmup = warmup_wanted(args)
    if args.demo:
        if warmup:
            engine.warmup()
        return run_demo(engine, args)
    try:
        _serve_forever(engine, args, warmup)
    except OSError as e:
        log.error("could not listen on %s:%d (%s); pick another --port or stop what holds it", args.host,
                  args.port, e)
        return 1
    return 0


# ---- bench serve ------------------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 1,4,16") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more integers >= 1")
    return vals


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers, e.g. 50,90,99") from None


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", help="server URL (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--model", help="model id (default: the first of GET /v1/models)")
    g = parser.add_argument_group("load")
    g.add_argument("--max-concurrency", type=_int_list, default=(4,),
                   help="requests in flight; a comma list runs one level each (default 4)")
    g.add_argument("--num-sessions", type=int, help="sessions per level (default: the level's concurrency)")
    g.add_argument("--num-turns", type=int, default=4, help="turns per session")
    g.add_argument("--think-time", type=float, default=1.0, help="mean seconds between a session's turns (0: none)")
    g.add_argument("--shared-prefix-len", type=int, default=256, help="words of the system prompt all share")
    g.add_argument("--input-len", type=int, default=128, help="words of a session's first user message")
    g.add_argument("--turn-input-len", type=int, default=32, help="words of each later user message")
    g.add_argument("--output-len", type=int, default=32, help="max_tokens per turn")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate --output-len tokens every turn (default on)")
    g.add_argument("--thinking", action="store_true", help="send chat_template_kwargs.thinking=true")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-warmups", type=int, default=0, help="uncounted single-turn requests sent first")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--long-prompt-rate", type=float, default=0.0,
                   help="long single-turn prompts a second arriving during each level (default 0: none)")
    g.add_argument("--long-prompt-len", type=int, default=3000,
                   help="words of a long prompt (default 3000: 7.9K tokens with the built-in tokenizer)")
    g = parser.add_argument_group("report")
    g.add_argument("--metric-percentiles", type=_float_list, default=(50.0, 90.0, 99.0),
                   help="comma list of percentiles to report (default 50,90,99)")
    g.add_argument("--result-dir", help="write bench_serve.json and the PNG plots here")
    return parser


def bench_config(args: argparse.Namespace) -> Any:
    from serving.bench import BenchConfig

    return BenchConfig(
        base_url=args.base_url or f"http://{args.host}:{args.port}", model=args.model,
        max_concurrency=tuple(args.max_concurrency), num_sessions=args.num_sessions, num_turns=args.num_turns,
        think_time_s=args.think_time, shared_prefix_len=args.shared_prefix_len, first_input_len=args.input_len,
        turn_input_len=args.turn_input_len, output_len=args.output_len, ignore_eos=args.ignore_eos,
        thinking=args.thinking, temperature=args.temperature, seed=args.seed, num_warmups=args.num_warmups,
        request_timeout_s=args.request_timeout, percentiles=tuple(args.metric_percentiles),
        long_prompt_len=args.long_prompt_len, long_prompt_rate=args.long_prompt_rate, result_dir=args.result_dir)


def run_bench(args: argparse.Namespace) -> int:
    """Exit status 0 when every request succeeded, 1 otherwise."""
    _ensure_logging()
    from serving.bench import run_bench as run

    try:
        cfg = bench_config(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    try:
        report = asyncio.run(run(cfg))
    except (OSError, RuntimeError) as e:
        log.error("bench failed: %s", e)
        return 1
    failed = sum(level["requests_failed"] for level in report["levels"])
    if failed:
        log.error("%d request(s) failed; see the warnings above", failed)
    return 1 if failed else 0
