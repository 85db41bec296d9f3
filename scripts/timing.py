"""The benches' one shared module: CUPTI kernel time (wall clock where CUPTI is unavailable), PyTorch's CUDA-event
time, the HBM and matmul-rate ceilings measured in the same run, the shared flags, tables and results files.
The engine benches' set-up: random device weights, the kernel configurations by name, a faked decode batch.
A timed jitted function must take every array it reads as an argument: a closed-over array becomes a constant."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# the benches import this first (their folder is on sys.path): the repository's packages then import without
# PYTHONPATH; with it, its order stands (`h200_checks.sh ab` puts another commit's packages before the tree's)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)
from dsv41 import model, quant  # noqa: E402
from dsv41 import params as P  # noqa: E402
from dsv41 import tokenizer as T  # noqa: E402
from dsv41.config import ModelConfig, preset, with_schedule  # noqa: E402
from serving.engine.backends import KernelOptions  # noqa: E402
from serving.engine.config import EngineConfig  # noqa: E402
from serving.engine.engine import Engine, SamplingParams, _Request  # noqa: E402

T0 = time.time()
_CUPTI_OK = None  # None: not tried yet; False after a failure (then wall clock only)


def elapsed_s() -> float:
    return time.time() - T0


def log(*a):
    print(f"[{elapsed_s():6.1f}s]", *a, flush=True)


def bench_args(doc: str, *, out: str = "", iters: int | None = None, budget_s: float | None = None):
    """A kernel bench's parser with the flags they share: --out (default $OUT), --iters, --budget-s."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", out), help="where the results JSON goes")
    if iters is not None:
        ap.add_argument("--iters", type=int, default=iters, help="timed calls a median is taken over")
    if budget_s is not None:
        ap.add_argument("--budget-s", type=float, default=budget_s, help="skip the remaining cases after this")
    return ap


def engine_args(doc: str, *, batches: str, weights: bool = True):
    """An engine bench's parser: bench_args' and --preset, --batches, --decode-ctx, --weights (with `weights`)."""
    ap = bench_args(doc)
    ap.add_argument("--preset", default="bench", help="tiny for a CPU smoke run")
    ap.add_argument("--batches", default=batches, help="decode batch sizes")
    ap.add_argument("--decode-ctx", "--ctx", type=int, default=4096, help="every request's context when timed")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the decode rows' temperature (0: greedy; > 0: each step also runs the sampling program)")
    if weights:
        ap.add_argument("--weights", choices=["bf16", "release"], default="bf16",
                        help="bf16: dense weights, the routed experts in FP4 where the FP4 GEMM runs; release: the "
                             "release's stored formats everywhere (FP8 linears, FP4 experts), as a checkpoint loads")
    ap.add_argument("--schedule", help="another preset's layer schedule at --preset's widths (flash: 40 layers)")
    ap.add_argument("--experts", type=int, help="routed experts a layer (default: the preset's); fewer to fit more "
                                                "layers, the widths stay")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                    help="runs of layers in one scanned body, or every layer unrolled (EngineConfig.scan_layers; "
                         "default: the engine's)")
    return ap


def model_config(args) -> ModelConfig:
    """engine_args' model: --preset, with --schedule's layers and --experts routed experts a layer."""
    cfg = preset(args.preset)
    if args.schedule:
        cfg = with_schedule(cfg, args.schedule)
    return cfg.replace(n_routed_experts=args.experts) if args.experts else cfg


def over_budget(budget_s: float, what: str) -> bool:
    """True (logged) past budget_s: the caller skips `what`, so the device call's limit does not cut the table."""
    if elapsed_s() <= budget_s:
        return False
    log("budget reached, skipping", what)
    return True


def failure(what: str, ex: BaseException) -> str:
    """Logs a failure with its traceback -> the error text for its row (one failure must not lose the table)."""
    log(f"{what} FAILED: {type(ex).__name__}: {str(ex)[:500]}")
    traceback.print_exc()
    return repr(ex)[:1000]


@contextlib.contextmanager
def guarded(what: str, row: dict | None = None, key: str = "error", **on_error):
    """Runs the block (`as` gives it `row`); a failure is logged (`failure`) and, with `row`, its text goes to
    row[key] and `on_error` into row: one failure must not lose the table."""
    try:
        yield row
    except Exception as ex:  # noqa: BLE001
        err = failure(what, ex)
        if row is not None:
            row.update({key: err, **on_error})


def write_json(out_dir: str, name: str, obj) -> None:
    """obj as out_dir/name (nothing without out_dir); rewritten after each case, so a killed run keeps its rows."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as fh:
            json.dump(obj, fh, indent=1, default=str)


def median_wall_s(fn, reps=5):
    """Median wall-clock seconds of fn() (which must block on its results)."""
    return statistics.median(_wall(fn) for _ in range(reps))


def _wall(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cupti_kernels(fn) -> list[tuple[str, float]]:
    """[(kernel name, ms)] of every kernel fn() launches (fn must block until its results are ready)."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    try:
        fn()
    finally:
        timings = ext._cupti_get_timings(True)
    return list(timings or [])


def _cupti(runs):
    """runs() -> its CUPTI result, or None (logged once) where CUPTI is unavailable: then wall clock only."""
    global _CUPTI_OK
    if _CUPTI_OK is False:
        return None
    try:
        out, _CUPTI_OK = runs(), True
        return out
    except Exception as ex:  # noqa: BLE001
        log("CUPTI timing unavailable, wall clock only:", type(ex).__name__, str(ex)[:200])
        _CUPTI_OK = False


def how(names: list[str]) -> str:
    """How `time_gpu` timed a call, from the names it returned: 'cupti' or 'wall'."""
    return "wall" if names == ["wall-clock"] else "cupti"


def time_gpu(f, args, *, iters=20, flush=None):
    """-> (median GPU ms of one call f(*args) summed over its kernels, median ms of its longest kernel, its kernel
    names or ['wall-clock']). flush() (untimed) before each call when given, so the data comes from HBM."""
    jax.block_until_ready(f(*args))

    def flushed(fn):
        if flush is not None:
            jax.block_until_ready(flush())
        return fn(lambda: jax.block_until_ready(f(*args)))

    def stats(runs):
        return (statistics.median(sum(t for _, t in r) for r in runs),
                statistics.median(max(t for _, t in r) for r in runs), [n for n, _ in runs[0]])

    got = _cupti(lambda: stats([flushed(cupti_kernels) for _ in range(iters)]))
    if got:
        return got
    ts = [flushed(_wall) * 1e3 for _ in range(iters)]
    return statistics.median(ts), statistics.median(ts), ["wall-clock"]


def time_calls(fn, arg_sets, reps=5, serial=False):
    """Median seconds a call of the jitted fn over `arg_sets` (rotated) -> (CUPTI kernel time or None, wall).
    Wall: calls queued back to back (one at a time with `serial`: the interpreter is not re-entrant), so where a
    call's GPU time is below JAX's dispatch cost it is the dispatch rate."""
    for a in arg_sets:
        jax.block_until_ready(fn(*a))

    def rotate():
        for a in arg_sets:
            out = fn(*a)
            if serial:
                jax.block_until_ready(out)
        jax.block_until_ready(out)

    wall = median_wall_s(rotate, reps) / len(arg_sets)
    cupti = None if serial else _cupti(lambda: statistics.median(
        sum(ms for _, ms in cupti_kernels(lambda: jax.block_until_ready([fn(*a) for a in arg_sets])))
        / 1e3 / len(arg_sets) for _ in range(reps)))
    return cupti, wall


def cuda_time_us(fn, iters=20, warmup=3, flush=None) -> float:
    """PyTorch: median microseconds of fn() between two CUDA events, flush() (untimed) before each when given."""
    import torch

    ts = []
    for i in range(warmup + iters):
        if flush is not None:
            flush()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        if i >= warmup:
            ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)


def l2_flusher(mib=256):
    """PyTorch: a callable that writes `mib` MiB on the GPU (more than the H200's 60 MB of L2)."""
    import torch
    buf = torch.empty(mib << 18, dtype=torch.float32, device="cuda")
    return lambda: buf.add_(1.0)


def jax_flusher(mib=256):
    """JAX: a callable that rewrites `mib` MiB on the device, to evict the L2 between timed calls."""
    buf, f = jnp.zeros((mib << 18,), jnp.float32), jax.jit(lambda b: b + 1.0)
    return lambda: f(buf)


def ceilings(quick=False) -> dict:
    """HBM bandwidth (TB/s) and bf16 matmul rate (TFLOP/s) measured now: PyTorch's f32 sum, its copy (read + write)
    and 8192^3 matmul (CUDA events), XLA's sum and matmul (CUPTI); 'hbm_TBps' / 'mm_TFLOPs' the best. `quick`:
    small XLA sizes only (a CPU run)."""
    res = {}
    if not quick:
        try:
            import torch

            assert torch.cuda.is_available()
            n = (1 << 31) // 4
            x, y = torch.randn(n, device="cuda", dtype=torch.float32), torch.empty(n, device="cuda")
            res["hbm_torch_sum_TBps"] = n * 4 / cuda_time_us(x.sum, iters=30) / 1e6
            res["hbm_torch_copy_TBps"] = 2 * n * 4 / cuda_time_us(lambda: y.copy_(x), iters=10) / 1e6
            del x, y
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            res["mm_torch_TFLOPs"] = 2 * 8192**3 / cuda_time_us(lambda: a @ a, iters=10) / 1e6
            del a
            torch.cuda.empty_cache()
        except Exception as ex:  # noqa: BLE001
            log("PyTorch ceilings failed:", type(ex).__name__, str(ex)[:200])
    n = 1 << 20 if quick else (1 << 31) // 4
    x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
    res["hbm_xla_sum_TBps"] = n * 4 / (time_gpu(jax.jit(jnp.sum), (x,), iters=10)[0] * 1e-3) / 1e12
    del x
    s = 256 if quick else 8192
    a = jax.random.normal(jax.random.key(2), (s, s), jnp.bfloat16)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    res["mm_xla_TFLOPs"] = 2 * s**3 / (time_gpu(mm, (a, a), iters=10)[0] * 1e-3) / 1e12
    res["hbm_TBps"] = max(v for k, v in res.items() if k.startswith("hbm"))
    res["mm_TFLOPs"] = max(v for k, v in res.items() if k.startswith("mm_"))
    return res


def bench_ceilings() -> dict:
    """`ceilings`, logged with the devices; where measuring fails, the H200's usual figures marked 'assumed'."""
    log("devices", jax.devices(), "jax", jax.__version__)
    try:
        c = ceilings()
    except Exception as ex:  # noqa: BLE001
        failure("ceilings", ex)
        c = {"hbm_TBps": 4.3, "mm_TFLOPs": 660.0, "assumed": True}
    log("ceilings", ceiling_line(c))
    return c


def ceiling_line(c: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in c.items())


def fmt(v, f="{:.2f}"):
    return "n/a" if v is None else f.format(v)


def print_table(header: list[str], rows: list[list], align: str = "") -> None:
    """A markdown table; align: one of 'l'/'r' a column (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if a == "l" else "---:" for a in align) + "|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |", flush=True)


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


# kernel configurations by name -> (attention, routed experts, mHC site, router site, FP8 linears)
KERNEL_NAMES = {"xla": "plain XLA", "attn": "the KV-path kernels", "pallas": "KV path + grouped FP4 expert GEMM",
                "all": "those + the fused mHC and router sites", "auto": "the engine's defaults, as `dsv41 serve` "
                "runs: with release weights the FP8 linear kernel too", "fp8": "auto + the FP8 linear kernel; needs "
                "release weights", "xla-linears": "auto with XLA's FP8 linears"}
KERNELS = {"xla": ("xla", "xla", "xla", "xla", "xla"), "attn": ("pallas", "xla", "xla", "xla", "xla"),
           "pallas": ("pallas", "pallas", "xla", "xla", "xla"), "all": ("pallas", "pallas", "pallas", "pallas", "xla"),
           "auto": ("auto", "auto", "auto", "auto", "auto"), "fp8": ("auto", "auto", "auto", "auto", "pallas"),
           "xla-linears": ("auto", "auto", "auto", "auto", "xla")}


# configuration suffixes (auto+unfused-rope+kernel-topk): what each changes from the engine's defaults
SUFFIXES = {"unfused-rope": "q / o rotated in XLA around the attention kernel (KernelOptions(fuse_rope=False))",
            "xla-indexer": "prefill chunks' indexers in XLA, not through the scoring kernels "
                           "(KernelOptions(prefill_indexer_kernel=False))",
            "kernel-topk": "the indexers' top-k threshold by topk_select (KernelOptions(indexer_topk='kernel'))",
            "one-pass-indexer": "prefill chunks' encoder indexers over the whole block table in one pass, not by the "
                                "blocks of 8192 entries they see (KernelOptions(prefill_indexer_block_entries=0))"}


def kernels_of(config: str) -> tuple[str, ...]:
    """A configuration name -> its kernel backends (KERNELS); suffixes after '+' (SUFFIXES) change one option."""
    name, *suffixes = config.split("+")
    unknown = [s for s in suffixes if s not in SUFFIXES]
    if name not in KERNELS or unknown:
        raise SystemExit(f"configuration {config!r}: choose one of {sorted(KERNELS)}, optionally with "
                         f"+{' +'.join(SUFFIXES)}")
    return KERNELS[name]


def make_engine(cfg, params, replay, max_len, seqs, backend="xla", replay_tokens=None, min_prefill_bucket=2048,
                own_params=False, **config):
    """An engine of `engine_config`'s configuration. own_params: the caller hands params over (`Engine`'s)."""
    return Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg), config=engine_config(
        cfg, replay, max_len, seqs, backend, replay_tokens, min_prefill_bucket, **config), own_params=own_params)


def engine_config(cfg, replay, max_len, seqs, backend="xla", replay_tokens=None, min_prefill_bucket=2048,
                  **config) -> EngineConfig:
    """`backend`'s kernels (`kernels_of`), no prefix cache, prefill chunks of 2048 (a shorter prompt padded to
    min_prefill_bucket, then to a power of two), decode tokens read on the host unless `config` says device_feed
    (the benchmarks time the loop they name; bench_device_feed.py times the fed one); `config`: other EngineConfig
    fields."""
    config.setdefault("device_feed", False)
    attn, moe_be, mhc_be, router_be, linear_be = kernels_of(backend)
    suffixes = backend.split("+")[1:]
    opts = KernelOptions(fuse_rope="unfused-rope" not in suffixes,
                         prefill_indexer_kernel="xla-indexer" not in suffixes,
                         indexer_topk="kernel" if "kernel-topk" in suffixes else "auto",
                         prefill_indexer_block_entries=0 if "one-pass-indexer" in suffixes
                         else KernelOptions.prefill_indexer_block_entries)
    return EngineConfig(
        max_num_seqs=seqs, max_model_len=max_len, max_num_batched_tokens=2048, swa_bounded_replay=replay,
        swa_replay_tokens=replay_tokens or cfg.window_size, enable_prefix_caching=False,
        min_prefill_bucket=min_prefill_bucket,
        attention_backend=attn, moe_backend=moe_be, mhc_backend=mhc_be, router_backend=router_be,
        linear_backend=linear_be, kernel_options=opts, **config)


def with_fp4_experts(params):
    """The routed experts quantized to the release's FP4 (what the grouped FP4 kernel reads); the rest stays."""
    q = jax.jit(quant.quantize_fp4_weight)
    layers = [{**lp, "ffn": {**lp["ffn"], "experts": {k: q(w) for k, w in lp["ffn"]["experts"].items()}}}
              for lp in params["layers"]]
    return {**params, "layers": layers}


def fake_decode_state(eng, B, ctx, temperature=0.0):
    """B running requests at position ctx with their pages assigned (the pool holds zeros: cost is the same).
    temperature > 0: every request draws (no top-k / top-p), so each step also runs the sampling program."""
    eng.running.clear()
    pages = iter(range(eng.layout.num_pages))
    for i in range(B):
        r = _Request(f"d{i}", [5] * ctx, SamplingParams(max_tokens=10**6, temperature=temperature, seed=i,
                                                         ignore_eos=True), None, float(i),
                     prefill_len=ctx)
        r.output, r.computed, r.rank, r.slot = [7], ctx, 0, i
        r.pages = [next(pages) for _ in range(-(-(ctx + 1) // eng.layout.page_tokens))]
        r.history = eng.hasher.initial_history(1)
        eng.running[r.id] = r
