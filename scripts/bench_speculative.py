"""DSpark speculative decoding on one GPU: the step cost of verify + draft against a plain decode step, and the
decode rate that cost gives at each acceptance length (issue #41's table for docs/PERFORMANCE.md).

    PYTHONPATH=. python3 scripts/bench_speculative.py [--batches 1,8,64] [--decode-ctx 4096] [--k 5] [--cut]

The bench preset (Flash's per-layer widths) with its three DSpark stages at Flash's widths (128 experts, top-3), in
the release's stored formats (FP8 linears, FP4 experts) with the engine's default kernels, as `dsv41 serve` runs.
Random weights accept almost no draft, so the speculative engine runs with forced acceptance: every step takes
k drafts and the bonus token, so its contexts grow and its rings wrap as they would at full acceptance. A step of
either engine is timed end to end (`Engine.step`: host batch, program, host bookkeeping; --reps steps in a loop and
the read that ends it, divided by --reps, the median of 3 such blocks). The plain step is timed twice: as `dsv41
serve` runs it on a GPU (its tokens fed on the device, `EngineConfig.device_feed`: the step N + 1 dispatched before
step N's tokens are read), the baseline of the speed-ups, and with each step's tokens read on the host, as the
speculative step runs unless --fed-spec. At acceptance length L (tokens a step, 1 + accepted
drafts) the speculative rate is B * L / step; L = 3.51 is vLLM's agentic benchmark.
--k 1,2,5 times a program of each k (a short-k program's cost); --cut adds the largest k at confidence_threshold 1
(no draft verified: the k-wide program with its draft columns masked); the speculative step runs as the platform
runs it (cut at the split layer on a GPU, as the plain step), or with --split-spec both as one program and cut;
--fed-spec adds each speculative step fed on the device. The rows here are greedy unless --temperature. Where the
host picks the sampling branch (`SpeculativeConfig.greedy_program`, a GPU's default) an all-greedy step runs the
program without sampling and a sampled one (--temperature) the program filtering every row; there
--sampling-program adds each with the branch on the device (greedy_program false: one `lax.switch` program).
--preset tiny: a CPU smoke test.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import statistics
import time

from timing import engine_args, fake_decode_state, kernels_of, make_engine, model_config  # noqa: I001 (sys.path)
from timing import write_json
import jax

from dsv41 import params as P
from serving.engine.config import SpeculativeConfig

log = logging.getLogger("bench_speculative")
LENGTHS = (1.0, 2.0, 3.0, 3.51, 4.0, 5.0, 6.0)
BLOCKS = 3  # loops of --reps steps; a step's time is their median


def step_time(cfg, params, B: int, ctx: int, reps: int, max_len: int, spec: SpeculativeConfig | None,
              temperature: float = 0.0, backend: str = "auto", split_spec: bool | None = None, fed: bool = False):
    """-> (first step s (compile), median step s) of B requests decoding at position ctx in an engine of the
    backend's kernels (`timing.kernels_of`: `auto` is serve's), one decode bucket of B rows, at that temperature;
    split_spec: a speculative step in two programs or one (None: the platform's, two on a GPU; a plain step: the
    platform's split either way); fed: the step's tokens (a speculative step's chunk) fed on the device."""
    gc.collect()  # the engine before: its pool and programs freed before this one takes the memory
    eng = make_engine(cfg, params, True, max_len, B, backend, min_decode_bucket=B, speculative_config=spec,
                      device_feed=fed, split_decode=split_spec if spec is not None else None)
    if split_spec and spec is not None and len(eng.decode_kinds) != 2:
        raise SystemExit(f"--split-spec: this model's DSpark reads layers {cfg.dspark_target_layer_ids}, not all past "
                         f"the split layer {cfg.split_layer}, so its step cannot be cut there; drop --split-spec")
    fake_decode_state(eng, B, ctx, temperature)
    first = _loop(eng, 1)
    return first, statistics.median(_loop(eng, reps) for _ in range(BLOCKS))


def _loop(eng, steps: int) -> float:
    """Seconds a step over `steps` calls of `Engine.step` and the read of what the last one left in flight."""
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    eng._read()
    return (time.perf_counter() - t) / steps


def main():
    ap = engine_args(__doc__, batches="1,8,64", weights=False)
    ap.add_argument("--k", default="5", help="num_speculative_tokens, one program each (e.g. 1,2,5)")
    ap.add_argument("--cut", action="store_true", help="also the largest k with confidence_threshold 1")
    ap.add_argument("--split-spec", action="store_true",
                    help="time each speculative step as one program and cut at the split layer (EngineConfig."
                         "split_decode: run_decode_first, then run_spec_rest); without it, as the platform runs it "
                         "(cut on a GPU)")
    ap.add_argument("--fed-spec", action="store_true",
                    help="also time each speculative step fed on the device (EngineConfig.device_feed: its chunk "
                         "built from the step before, programs.SpecFeed), beside the one read on the host")
    ap.add_argument("--sampling-program", action="store_true",
                    help="also time each speculative step with its sampling branch on the device (SpeculativeConfig."
                         "greedy_program false: a lax.switch, a host round trip on a GPU; a GPU's default picks the "
                         "branch on the host)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backend", default="auto",
                    help="the engines' kernels (timing.KERNELS, with +suffixes); a list times the speculative step "
                         "with each, the plain step with the first")
    args = ap.parse_args()
    backends = args.backend.split(",")
    for b in backends:
        kernels_of(b)  # a bad name fails here, before minutes of set-up
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = model_config(args).replace(n_mtp_layers=3)
    batches = [int(b) for b in args.batches.split(",")]
    params = P.init_params(cfg, seed=0)
    ks = sorted(int(k) for k in args.k.split(","))
    max_len = -(-(args.decode_ctx + (ks[-1] + 1) * (BLOCKS * args.reps + 2) + 64) // 64) * 64
    specs = [(f"k={k}", SpeculativeConfig(num_speculative_tokens=k, forced_acceptance=True)) for k in ks]
    specs += [(f"k={ks[-1]} cut to 0", SpeculativeConfig(num_speculative_tokens=ks[-1], forced_acceptance=True,
                                                         confidence_threshold=1.0))] * args.cut
    host = SpeculativeConfig().uses_greedy_program(jax.default_backend())
    program = ("greedy program" if args.temperature == 0 else "filtering program") if host else "switch program"
    specs = [(f"{name}, {program}", spec) for name, spec in specs]
    specs += [(name.replace(program, "switch program"), dataclasses.replace(spec, greedy_program=False))
              for name, spec in specs] * (args.sampling_program and host)
    rows = []
    for B in batches:
        fp, tp = step_time(cfg, params, B, args.decode_ctx, args.reps, max_len, None, args.temperature, backends[0],
                           fed=True)
        th = step_time(cfg, params, B, args.decode_ctx, args.reps, max_len, None, args.temperature, backends[0])[1]
        for backend in backends:
            for (name, spec), split, fed in itertools.product(specs, (False, True) if args.split_spec else (None,),
                                                              (False, True)[:1 + args.fed_spec]):
                fs, ts = step_time(cfg, params, B, args.decode_ctx, args.reps, max_len, spec, args.temperature,
                                   backend, split, fed)
                name += {None: "", False: ", one program", True: ", two programs"}[split] + (", fed" if fed else "")
                rows.append((B, backend, name, 0 if spec.confidence_threshold else spec.num_speculative_tokens,
                             tp, th, ts))
                log.info("B=%d plain %.2f ms fed, %.2f ms read on the host, %s %s %.2f ms (first calls %.1f / "
                         "%.1f s)", B, tp * 1e3, th * 1e3, backend, name, ts * 1e3, fp, fs)

    dev = jax.devices()[0]
    print(f"\n{dev.device_kind}, jax {jax.__version__}, {args.preset} preset + 3 DSpark stages "
          f"({cfg.dspark_n_routed_experts} experts, top-{cfg.dspark_num_experts_per_tok}), plain step's kernels "
          f"{backends[0]}, context {args.decode_ctx}\n")
    lengths = [L for L in LENGTHS if L <= ks[-1] + 1]
    print("Speed-ups (x) against the plain step as serve runs it (fed); in brackets against the plain step with its "
          "tokens read on the host.\n")
    print("| batch | kernels | program | plain step ms, fed / read on the host | verify + draft step ms | cost ratio "
          "| plain tok/s | " + " | ".join(f"L={L:g} tok/s (x)" for L in lengths) + " |")
    print("|---" * (7 + len(lengths)) + "|")
    for B, backend, name, k, tp, th, ts in rows:
        cells = [f"{B * L / ts:,.0f} ({tp * L / ts:.2f}x) [{th * L / ts:.2f}x]" if L <= k + 1 else ""
                 for L in lengths]
        print(f"| {B} | {backend} | {name} | {tp * 1e3:.2f} / {th * 1e3:.2f} | {ts * 1e3:.2f} | {ts / tp:.2f} | "
              f"{B / tp:,.0f} | " + " | ".join(cells) + " |")
    write_json(args.out, "bench_speculative.json", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
