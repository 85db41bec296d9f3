"""Where the idle time between a decode step's kernels goes: a `jax.profiler` trace of engine decode steps, the
GPU's kernel timeline, and the gaps in it by what runs next. Bench preset (Flash widths, 8 layers), GPU only.

    PYTHONPATH=. python3 scripts/trace_gaps.py --backend auto --batch 1 [--steps 5] [--out DIR]

`scripts/profile_step.py` sums CUPTI kernel durations (no start times): at batch 1 about half of the step is
not kernel time, and CUDA graphs did not recover it (docs/PERFORMANCE.md). This script reads the trace's start
times, so it can say where the idle time sits: before our Mosaic GPU kernels (a custom call's launch path),
evenly between small XLA fusions (launch throughput), or in a few long stalls (a host synchronisation). Where
the trace links kernels to their host-side launch calls (CUPTI correlation ids), it also reports how long each
kernel waited on the GPU after its launch returned: near zero everywhere means the GPU was starved by the host.

The timed region is the device program alone (`programs.run_full` on a prepared batch, as bench_engine's
"device" column), several steps back to back; the first traced step is dropped. The engine's whole step
(`Engine.step`: scheduling, host inputs, the program, the sampled ids back, bookkeeping) measured 1.1-2.2 ms
longer than that on the H200 (docs/PERFORMANCE.md), more than the stubbed step's 0.1-0.6 ms of Python on the
CPU; a cProfile of engine steps on the GPU machine (printed last) says where that time goes.

XLA executes a program's command buffers (CUDA graphs) as plain kernel launches while a profiler session is
active, so the traced timeline is the step without them. `--no-trace` times the program as it runs outside a
trace; with `TF_CPP_VMODULE=command_buffer_thunk=3` XLA then logs every command buffer update (re-recording a
graph whose captured buffer addresses changed) with its count of commands.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import glob
import io
import json
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))
from bench_engine import device_params, fake_decode_state, kernels_of, make_engine, with_fp4_experts  # noqa: E402
from profile_step import kind_of  # noqa: E402

from dsv41.config import preset  # noqa: E402
from serving.engine import programs  # noqa: E402

log = logging.getLogger("trace_gaps")

GAP_BINS_US = (1, 2, 5, 10, 20, 50, 100)  # upper edges; the last bin is everything above


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    start_ns: float
    dur_ns: float
    line: str
    stats: dict

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.dur_ns


def _stats(event) -> dict:
    try:
        return {k: v for k, v in event.stats}
    except Exception:  # a stat the bindings cannot convert
        return {}


STEP_MARK = "dsv41_step"  # the host annotation around each traced step


def is_kernel_stream(line_name: str) -> bool:
    """A device line that holds kernels: a stream, not one for copies alone. The H200's trace names the compute
    stream after every kind of work on it, 'Stream #14(Memset,Compute,MemcpyD2H,MemcpyD2D)', beside
    'Stream #15(MemcpyH2D)' (2026-12-01)."""
    name = line_name.lower()
    return "stream" in name and ("compute" in name or "memcpy" not in name)


def read_trace(path: str, device_plane: str = "/device:GPU:0"
               ) -> tuple[list[Kernel], dict[int, float], list[tuple[float, float]]]:
    """An .xplane.pb -> (kernels on the device plane sorted by start, {correlation id: host launch call end ns},
    the host's STEP_MARK windows (start, end) sorted). Device lines that are not kernel streams (memcpy, XLA op
    and module summaries) are skipped by name."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(path)
    kernels, launches, windows = [], {}, []
    for plane in pd.planes:
        if plane.name.split(" ")[0] == device_plane:  # the name may carry a suffix after a space
            for line in plane.lines:
                if not is_kernel_stream(line.name):
                    continue
                for e in line.events:
                    kernels.append(Kernel(e.name, float(e.start_ns), float(e.duration_ns), line.name, _stats(e)))
        elif plane.name.startswith("/host"):
            for line in plane.lines:
                for e in line.events:
                    if e.name == STEP_MARK:
                        windows.append((float(e.start_ns), float(e.start_ns + e.duration_ns)))
                    if "launch" not in e.name.lower():
                        continue
                    cid = _stats(e).get("correlation_id")
                    if cid is not None:
                        launches[int(cid)] = float(e.start_ns + e.duration_ns)
    kernels.sort(key=lambda k: k.start_ns)
    return kernels, launches, sorted(windows)


def split_steps(kernels: list[Kernel], windows: list[tuple[float, float]], min_step_gap_ns: float
                ) -> list[list[Kernel]]:
    """Kernels -> steps: those starting inside each host step window (every step ends in a block_until_ready
    inside its window); without windows, a new step starts after an idle stretch of at least min_step_gap_ns."""
    if windows:
        steps = [[k for k in kernels if a <= k.start_ns <= b] for a, b in windows]
        return [s for s in steps if s]
    steps: list[list[Kernel]] = []
    end = -float("inf")
    for k in kernels:
        if k.start_ns - end >= min_step_gap_ns or not steps:
            steps.append([])
        steps[-1].append(k)
        end = max(end, k.end_ns)
    return steps


def window_edges(kernels: list[Kernel], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(ns from the host's call to the step's first kernel, ns from its last kernel's end to the host having the
    result) per host step window with kernels: the time a step spends outside its kernels' span (dispatch,
    input copies, the result's copy back)."""
    out = []
    for a, b in windows:
        ks = [k for k in kernels if a <= k.start_ns <= b]
        if ks:
            out.append((ks[0].start_ns - a, b - max(k.end_ns for k in ks)))
    return out


def gaps(step: list[Kernel]) -> list[tuple[float, Kernel, Kernel]]:
    """(idle ns, kernel before, kernel after) for every stretch in which no kernel of the step runs."""
    out, end, prev = [], step[0].end_ns, step[0]
    for k in step[1:]:
        if k.start_ns > end:
            out.append((k.start_ns - end, prev, k))
        if k.end_ns >= end:
            end, prev = k.end_ns, k
    return out


def summarize_step(step: list[Kernel], launches: dict[int, float]) -> dict:
    """One step's wall (first kernel start to last kernel end), busy time, idle time by gap size and by the kind
    of the kernel after the gap, the largest gaps, and (with launch records) each kernel's wait after launch."""
    wall = max(k.end_ns for k in step) - step[0].start_ns
    gs = gaps(step)
    idle = sum(g for g, _, _ in gs)
    bins = collections.Counter()
    by_next = collections.defaultdict(lambda: [0, 0.0])
    for g, _, nxt in gs:
        us = g / 1e3
        label = next((f"<= {b} us" for b in GAP_BINS_US if us <= b), f"> {GAP_BINS_US[-1]} us")
        bins[label] += g
        by_next[kind_of(nxt.name)][0] += 1
        by_next[kind_of(nxt.name)][1] += g
    waits = []
    for k in step:
        cid = k.stats.get("correlation_id")
        if cid is not None and int(cid) in launches:
            waits.append((k.start_ns - launches[int(cid)]) / 1e3)
    top = sorted(gs, key=lambda t: -t[0])[:12]
    return {
        "kernels": len(step), "wall_us": wall / 1e3, "busy_us": (wall - idle) / 1e3, "idle_us": idle / 1e3,
        "gaps": len(gs), "idle_by_size_us": {k: v / 1e3 for k, v in bins.items()},
        "idle_by_next_kind_us": {k: (n, v / 1e3) for k, (n, v) in by_next.items()},
        "launch_wait_us": waits,
        "top_gaps": [(g / 1e3, a.name, b.name) for g, a, b in top],
    }


def print_report(label: str, steps: list[dict]) -> None:
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    print(f"\n### {label}: {len(steps)} steps (medians)\n")
    print("| kernels | wall us | busy us | idle us | idle share | gaps |\n|---:|---:|---:|---:|---:|---:|")
    print(f"| {med('kernels'):.0f} | {med('wall_us'):.1f} | {med('busy_us'):.1f} | {med('idle_us'):.1f} | "
          f"{100 * med('idle_us') / med('wall_us'):.0f}% | {med('gaps'):.0f} |")
    s0 = steps[len(steps) // 2]  # one representative step for the breakdowns
    print("\n| idle stretch | idle us (one step) |\n|---|---:|")
    order = [f"<= {b} us" for b in GAP_BINS_US] + [f"> {GAP_BINS_US[-1]} us"]
    for k in order:
        if k in s0["idle_by_size_us"]:
            print(f"| {k} | {s0['idle_by_size_us'][k]:.1f} |")
    print("\n| kernel after the gap | gaps | idle us |\n|---|---:|---:|")
    for k, (n, us) in sorted(s0["idle_by_next_kind_us"].items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {n} | {us:.1f} |")
    if s0["launch_wait_us"]:
        w = sorted(s0["launch_wait_us"])
        q = lambda f: w[min(len(w) - 1, int(f * len(w)))]  # noqa: E731
        print(f"\nkernel start - its launch call's end (us): p10 {q(0.1):.1f}, median {q(0.5):.1f}, p90 "
              f"{q(0.9):.1f} over {len(w)} kernels (near 0: the GPU waits on the host)")
    else:
        print("\n(no kernel-to-launch correlation in this trace)")
    print("\n| largest gaps us | kernel before | kernel after |\n|---:|---|---|")
    for g, a, b in s0["top_gaps"]:
        print(f"| {g:.1f} | `{a[:60]}` | `{b[:60]}` |")


def wall_ms(fn, n: int) -> list[float]:
    """n wall-clock times of fn(), ms."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t))
    return ts


def host_profile(eng, device_step, n: int) -> None:
    """Engine.step vs the device program alone (medians of n), then the engine steps' Python under cProfile."""
    dev, whole = statistics.median(wall_ms(device_step, n)), statistics.median(wall_ms(eng.step, n))
    print(f"\nEngine.step {whole:.2f} ms, the device program alone {dev:.2f} ms (medians of {n}): "
          f"{whole - dev:.2f} ms more")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        eng.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
    print(f"\ncProfile of {n} engine steps (cumulative):\n" + buf.getvalue().split("\n", 4)[-1].strip())


def call_overhead(eng, b, s, n: int) -> None:
    """What a call costs before any of the model's work: programs that take the decode program's arguments
    (parameters, the donated pool, the batch) and only pass the pool through, against one that takes the batch
    alone. A gap between them is the per-argument cost of a call (the step's parameters are hundreds of arrays)."""
    median_ms = lambda fn: statistics.median(wall_ms(fn, n))  # noqa: E731
    everything = jax.jit(lambda params, pool, b, s: (pool, b.tokens[:, 0] + s.top_k), donate_argnums=1)
    batch_only = jax.jit(lambda b, s: b.tokens[:, 0] + s.top_k)

    def run_everything(params):
        eng.pool, tok = everything(params, eng.pool, b, s)
        tok.block_until_ready()

    def run_batch_only():
        batch_only(b, s).block_until_ready()

    run_everything(eng.params), run_batch_only()
    n_args = len(jax.tree.leaves((eng.params, eng.pool, b, s)))
    print(f"\na call that passes the arguments through ({n_args} arrays: parameters, the donated pool, the batch): "
          f"{median_ms(lambda: run_everything(eng.params)):.3f} ms; the batch alone ({len(jax.tree.leaves((b, s)))} arrays): {median_ms(run_batch_only):.3f} ms "
          f"(medians of {n})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto",
                    help="a bench_engine.py configuration: auto, xla, ..., with its +suffixes (auto+unfused-rope)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--decode-ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step-gap-us", type=float, default=200.0,
                    help="without step annotations in the trace: an idle stretch at least this long separates "
                         "two traced steps")
    ap.add_argument("--trace", default="", help="analyse this .xplane.pb instead of running (any machine)")
    ap.add_argument("--host-steps", type=int, default=20, help="engine steps under cProfile (0: none)")
    ap.add_argument("--no-trace", action="store_true",
                    help="only the device program and Engine.step times: XLA runs a program's command buffers "
                         "(CUDA graphs) only outside a profiling session, so the trace shows the step without "
                         "them; with TF_CPP_VMODULE=command_buffer_thunk=3 XLA logs each command buffer update")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    kernels_of(args.backend)  # an unknown configuration stops here, before any work
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    path = args.trace
    if not path:
        if jax.devices()[0].platform != "gpu":
            sys.exit("trace_gaps.py runs the engine on a GPU (or give --trace FILE)")
        cfg = preset("bench")
        params = device_params(cfg)
        if kernels_of(args.backend)[1] != "xla":
            params = with_fp4_experts(params)
        eng = make_engine(cfg, params, True, -(-(args.decode_ctx + 256) // 64) * 64, args.batch, args.backend)
        fake_decode_state(eng, args.batch, args.decode_ctx)
        eng.step()  # compile
        b, s = eng.decode_inputs(list(eng.running.values()))

        def step():
            eng.pool, _, tok = programs.run_full(eng.params, eng.pool, b, s, **eng.static)
            tok.block_until_ready()

        for _ in range(3):
            step()
        if args.no_trace:
            host_profile(eng, step, args.host_steps or 20)
            call_overhead(eng, b, s, args.host_steps or 20)
            return
        tdir = os.path.join(args.out or tempfile.mkdtemp(), "trace")
        with jax.profiler.trace(tdir):
            for _ in range(args.steps + 1):
                with jax.profiler.TraceAnnotation(STEP_MARK):
                    step()
        found = sorted(glob.glob(os.path.join(tdir, "**", "*.xplane.pb"), recursive=True))
        if not found:
            sys.exit(f"no .xplane.pb under {tdir}")
        path = found[-1]
    kernels, launches, windows = read_trace(path)
    if not kernels:
        # what the trace holds instead, to fix the reader against (the H200 trace of 2026-12-01 found none)
        from jax.profiler import ProfileData

        for plane in ProfileData.from_file(path).planes:
            for line in plane.lines:
                events = list(line.events)
                log.info("plane %r line %r: %d events, first %s", plane.name, line.name, len(events),
                         [e.name for e in events[:3]])
        sys.exit(f"{path}: no kernels on a /device:GPU:0 stream line (a trace from a GPU run is needed; its "
                 f"planes and lines are listed above)")
    steps = split_steps(kernels, windows, args.step_gap_us * 1e3)
    log.info("%s: %d kernels, %d steps (%d step marks), %d launch records", path, len(kernels), len(steps),
             len(windows), len(launches))
    steps = steps[1:] if len(steps) > 2 else steps
    summaries = [summarize_step(s, launches) for s in steps]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, bench preset decode, kernels={args.backend}, "
          f"batch {args.batch}, context {args.decode_ctx}")
    print_report(f"decode step, batch {args.batch}", summaries)
    if windows:  # the host's view: from the call to the result back, dispatch before the first kernel included
        print(f"\nhost step window (call to block_until_ready): median "
              f"{statistics.median(b - a for a, b in windows[1:] or windows) / 1e3:.1f} us")
        edges = window_edges(kernels, windows[1:] or windows)
        if edges:
            print(f"of it before the first kernel: median {statistics.median(e[0] for e in edges) / 1e3:.1f} us; "
                  f"after the last kernel: median {statistics.median(e[1] for e in edges) / 1e3:.1f} us")
    if not args.trace and args.host_steps:
        host_profile(eng, step, args.host_steps)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "trace_gaps.json"), "w") as fh:
            json.dump({"args": vars(args), "steps": summaries}, fh, indent=1)


if __name__ == "__main__":
    main()
