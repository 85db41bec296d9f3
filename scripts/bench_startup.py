"""Start-up cost per program: lower and compile time of each program of `Engine.program_shapes()` with `dsv41
serve`'s engine flags, from an empty persistent compilation cache (cold), then from the cache the cold run filled
(warm), each run in a fresh process (jax opens its cache once per process and keeps compiled programs in memory).

    PYTHONPATH=. python3 scripts/bench_startup.py --preset tiny     # CPU; --preset flash --abstract on one GPU

--abstract: weights and KV pool as jax.ShapeDtypeStruct (Engram tables one row), so a model larger than the device
(Flash on one H200) compiles as serving would compile it; with the parallelism flags (`--data-parallel-size`,
`--tensor-parallel-size`, `--enable-expert-parallel`) the sharded programs, placed as the engine places them. One
program at a time (warm-up overlaps several).

--serve: the user's path instead: `dsv41 serve FLAGS --warmup` from an empty cache, then again over the cache it
filled, each timed from the command's start to the first 200 of /health (and its CPU seconds), with the programs
its warm-up log reports, each one's time from the command's start to its report (the path to healthy: which
program came last, and how long after the start the compiles began); --server-logs DIR keeps both servers' logs:

    PYTHONPATH=. python3 scripts/bench_startup.py --serve --preset tiny    # CPU (issue target: <= 20 s cold)
    PYTHONPATH=. python3 scripts/bench_startup.py --serve                  # H200, bench preset, serve's defaults

--build: the engine's construction with random weights (what `dsv41 serve --preset` does before warm-up), by phase,
with the XLA compiles each ran:

    PYTHONPATH=. python3 scripts/bench_startup.py --build --preset bench

--lower-for cuda: on any host (no GPU needed), each program as a GPU engine would choose it (kernels, buckets),
traced and lowered for CUDA, not compiled: trace and lower seconds, the Mosaic GPU kernels it holds, the ops at
which a GPU call waits for the host (`serving/engine/host_round_trips.py`: logged by named scope), its size (with
`--speculative-config`, the abstract engine has DSpark's three stages). Lowering runs in one thread before any
compile can start, so it bounds a cold start from below:

    PYTHONPATH=. python3 scripts/bench_startup.py --abstract --lower-for cuda --preset bench

--trace-compile: where a compile's time goes, from a jax.profiler trace of each program's compile in this process
(abstract engine): the host events by name (XLA's passes, autotuning, PTX to binary; `Compile` is one Mosaic GPU
kernel compiled, which jaxlib runs one at a time in a process under one lock and again whenever an executable is
loaded in a new process), summed over the programs:

    PYTHONPATH=. python3 scripts/bench_startup.py --abstract --trace-compile --programs decode,encoder --smallest

How compile time grows with the layer count (flat: layers of one kind share one body, dsv41/layer_runs.py): the
smallest program of each kind named, cold only, 40 layers against 8:

    PYTHONPATH=. python3 scripts/bench_startup.py --abstract --cold-only --programs decode --smallest \
        --preset tiny40       # then --preset tiny (CPU); on the H200: --preset flash, --preset bench
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from unittest import mock

from timing import fmt, log, print_table  # noqa: I001 (first: puts the repository on sys.path)
import jax

from dsv41.config import preset
from serving import cli_serve, compilation_cache
from serving.engine import compile_events
from serving.engine.host_round_trips import host_round_trips
from serving.engine.warmup_progress import parse_report_line
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine

logger = logging.getLogger("bench_startup")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    cli_serve.add_serve_args(ap)  # the engine flags and their defaults exactly as `dsv41 serve` takes them
    ap.set_defaults(preset="bench")
    ap.add_argument("--abstract", action="store_true",
                    help="ShapeDtypeStruct weights and KV pool: compile a model that does not fit the device")
    ap.add_argument("--programs", help="comma-separated program kinds to measure (encoder, decoder, full, decode: "
                    "the decode step's program or programs, decode_first, decode_rest); default: all of "
                    "Engine.program_shapes()")
    ap.add_argument("--smallest", action="store_true", help="only the first (smallest) shape of each kind")
    ap.add_argument("--cold-only", action="store_true", help="skip the warm (cache hit) run")
    ap.add_argument("--serve", action="store_true",
                    help="time `dsv41 serve --warmup` with these flags to a healthy /health, cold then warm")
    ap.add_argument("--serve-timeout", type=float, default=1800, help="seconds a --serve run may take to be healthy")
    ap.add_argument("--server-logs", metavar="DIR",
                    help="with --serve: write each run's server log to DIR/serve_cold.txt and DIR/serve_warm.txt")
    ap.add_argument("--build", action="store_true",
                    help="time the engine's construction with random weights in this process, by phase (the weights "
                    "drawn; the engine: kernel layouts, layer stacking, KV pool), with the XLA compiles each ran")
    ap.add_argument("--lower-for", choices=["cuda"],
                    help="with --abstract: trace and lower each program for this platform as its engine would choose "
                    "them (kernels, buckets), on this host; no compile")
    ap.add_argument("--trace-compile", action="store_true",
                    help="with --abstract: trace each program's compile (jax.profiler) and print its host events")
    ap.add_argument("--child", choices=["cold", "warm"], help=argparse.SUPPRESS)  # one run, JSON on stdout
    return ap.parse_args(argv)


def abstract_engine(args: argparse.Namespace):
    """The serve engine of `args` over ShapeDtypeStruct weights and KV pool (`Engine.abstract`)."""
    if args.checkpoint:
        raise SystemExit("--abstract measures a preset (--preset tiny / bench / flash); drop --checkpoint")
    config = EngineConfig(**cli_serve.engine_kwargs(args, EngineConfig.field_names()))
    cfg = preset(args.preset)
    if config.speculative_config is not None and not cfg.n_mtp_layers:
        cfg = cfg.replace(n_mtp_layers=3)  # the bench preset leaves DSpark's stages out; its benches add the three
    return Engine.abstract(cfg, config)


def selected_shapes(eng, args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """The engine's program shapes, those of --programs' kinds, the first of each kind with --smallest."""
    shapes = eng.program_shapes()
    if args.programs:
        kinds = args.programs.split(",")
        if "decode" in kinds:
            kinds += eng.decode_kinds
        shapes = [s for s in shapes if s[0] in kinds]
    if args.smallest:
        shapes = [s for i, s in enumerate(shapes) if s[0] not in {t[0] for t in shapes[:i]}]
    return shapes


def measure(eng, args: argparse.Namespace) -> list[dict]:
    """Lowers and compiles each program of the engine, one at a time (times undisturbed by the others)."""
    rows = []
    shapes = selected_shapes(eng, args)
    for i, shape in enumerate(shapes):
        fn, fargs, static = eng._padding_call(*shape)
        t0 = time.perf_counter()
        lowered = fn.lower(*fargs, **static)
        t1 = time.perf_counter()
        with compile_events.capture() as c:
            compiled = lowered.compile()
        t2 = time.perf_counter()
        # the programs' sizes: on a busy machine a steadier measure of the layer count's cost than its times
        hlo = (len(lowered.as_text()), len(compiled.as_text() or ""))
        # jax keeps every compiled executable in memory; on the CPU, ~80 of the tiny preset's exhausted the
        # process's memory maps (LLVM: "Cannot allocate memory"). Each program is measured alone anyway.
        del lowered, compiled
        jax.clear_caches()
        kind, B, T, pages = shape
        rows.append({"kind": kind, "B": B, "T": T, "pages": pages, "lower_s": t1 - t0, "compile_s": t2 - t1,
                     "source": c.source, "hlo_chars": hlo})
        logger.info("%d/%d %s B=%d T=%d pages=%d: lower %.2f s, compile %.2f s (%s)", i + 1, len(shapes), kind, B,
                    T, pages, t1 - t0, t2 - t1, c.source)
    return rows


def measure_compile_trace(args: argparse.Namespace) -> None:
    """--trace-compile: each selected program lowered, then compiled under jax.profiler.trace (the compilation
    cache off: a real compile); prints the compile times and the host events by name, summed over the programs and
    for the first alone (later programs find its Mosaic GPU kernels compiled already)."""
    eng = abstract_engine(args)
    events: dict[str, list[float]] = {}  # name -> [count, of them in the first program, total ms, the first's ms]
    programs = []
    for i, shape in enumerate(selected_shapes(eng, args)):
        fn, fargs, static = eng._padding_call(*shape)
        t0 = time.perf_counter()
        lowered = fn.lower(*fargs, **static)
        t1 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="dsv41_compile_trace") as d:
            with jax.profiler.trace(d):
                compiled = lowered.compile()
            t2 = time.perf_counter()
            xplane = [os.path.join(root, f) for root, _, files in os.walk(d) for f in files
                      if f.endswith(".xplane.pb")][0]
            pd = jax.profiler.ProfileData.from_file(xplane)
        del lowered, compiled
        programs.append([f"{shape[0]} B={shape[1]} T={shape[2]} pages={shape[3]}", fmt(t1 - t0), fmt(t2 - t1)])
        for e in (e for p in pd.planes if p.name.startswith("/host") for line in p.lines for e in line.events):
            acc = events.setdefault(e.name[:80], [0, 0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += i == 0
            acc[2] += e.duration_ns / 1e6
            acc[3] += e.duration_ns / 1e6 if i == 0 else 0.0
        logger.info("%s: lower %.2f s, compile %.2f s (traced)", programs[-1][0], t1 - t0, t2 - t1)
    print_table(["program", "lower s", "compile s (traced)"], programs)
    print()
    print_table(["host event (nested events overlap)", "count", f"of them {programs[0][0]}", "total s", "its s"],
                [[f"`{name}`", n, n0, f"{ms / 1e3:.2f}", f"{ms0 / 1e3:.2f}"]
                 for name, (n, n0, ms, ms0) in sorted(events.items(), key=lambda kv: -kv[1][2])[:40]])


def measure_lowering(args: argparse.Namespace) -> None:
    """--lower-for: the abstract engine built as on that platform (jax's default backend reported as it while the
    engine chooses kernels and buckets), then each program traced and lowered for it; prints the table."""
    platform = {"cuda": "gpu"}[args.lower_for]
    with mock.patch.object(jax, "default_backend", lambda: platform):
        eng = abstract_engine(args)
    log(f"preset {args.preset}, lowered for {args.lower_for} on {jax.default_backend()} (attention backend "
        f"{eng.backends.attention!r})")
    rows, seen = [], set()
    for shape in selected_shapes(eng, args):
        fn, fargs, static = eng._padding_call(*shape)
        t0 = time.perf_counter()
        traced = fn.trace(*fargs, **static)
        t1 = time.perf_counter()
        text = traced.lower(lowering_platforms=(args.lower_for,)).as_text()
        t2 = time.perf_counter()
        # one Mosaic GPU custom call per kernel hash a program calls (a kernel called at several sites is lowered
        # once); jaxlib compiles each hash once in a process (pallas_kernels/kernel_hashes.py)
        hashes = set(re.findall(r'kernel_hash = "(.*?)"', text))
        trips = host_round_trips(traced.jaxpr)
        kind, B, T, pages = shape
        rows.append([kind, f"{B} x {T}", pages, t1 - t0, t2 - t1, len(hashes), len(hashes - seen), len(trips),
                     len(text) // 1000])
        seen |= hashes
        logger.info("%s B=%d T=%d: trace %.2f s, lower %.2f s, %d kernels, host round trips %s", kind, B, T, t1 - t0,
                    t2 - t1, len(hashes), collections.Counter(f"{k} in {n or 'the program'}" for k, n in trips))
    print_table(["program", "B x T", "pages", "trace s", "lower s", "Mosaic GPU kernels", "not in a program above",
                 "host round trips", "lowered k chars"], [[*r[:3], fmt(r[3]), fmt(r[4]), *r[5:]] for r in rows],
                "lrrrrrrrr")
    print()
    print_table(["programs", "trace s", "lower s", "kernels lowered", "kernel hashes (compiles in one process)"],
                [[len(rows), fmt(sum(r[3] for r in rows)), fmt(sum(r[4] for r in rows)), sum(r[5] for r in rows),
                  len(seen)]])


def measure_build(args: argparse.Namespace) -> None:
    """--build: Engine.from_preset's two phases timed apart (no persistent cache: every compile counted)."""
    from dsv41 import model
    from dsv41 import params as P
    from dsv41 import tokenizer as T

    compiles = {"n": 0, "s": 0.0}

    def on_duration(event: str, secs: float, **_) -> None:
        if event == compile_events.BACKEND_COMPILE:
            compiles["n"] += 1
            compiles["s"] += secs

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    rows = []

    def phase(name: str, fn):
        n, s, t0 = compiles["n"], compiles["s"], time.perf_counter()
        out = fn()
        jax.block_until_ready(out if not isinstance(out, Engine) else out.params)
        rows.append([name, time.perf_counter() - t0, compiles["n"] - n, compiles["s"] - s])
        logger.info("%s: %.2f s", name, rows[-1][1])
        return out

    phase("backend", jax.devices)
    cfg = preset(args.preset)
    config = EngineConfig(**cli_serve.engine_kwargs(args, EngineConfig.field_names()))
    params = phase("weights (init_params)", lambda: P.init_params(cfg, args.seed or 0))
    phase("engine (kernel layouts, layers, pool)",
          lambda: Engine(cfg, params, T.load_tokenizer(), model.hasher_for(params, cfg), config, own_params=True))
    rows.append(["total", sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows)])
    log(f"preset {args.preset}, {jax.devices()[0].device_kind}, {os.cpu_count()} host cores")
    print_table(["phase", "s", "XLA compiles", "compile s"], [[r[0], fmt(r[1]), r[2], fmt(r[3])] for r in rows],
                "lrrr")


def child(args: argparse.Namespace) -> None:
    compilation_cache.configure(compilation_cache.dir_from_args(args))
    t0 = time.perf_counter()
    eng = abstract_engine(args) if args.abstract else cli_serve.build_engine(args)
    build_s = time.perf_counter() - t0
    sys.stdout.write(json.dumps({"build_s": build_s, "programs": measure(eng, args)}) + "\n")


def run_child(argv: list[str], which: str, cache_dir: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", which, "--compilation-cache-dir", cache_dir]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr (its progress) passes through
    if out.returncode != 0:
        raise SystemExit(f"the {which} run failed (exit {out.returncode}); its log is above")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t0
    return res


def report(cold: dict, warm: dict | None) -> None:
    """The per-program table and the totals; warm None: the cold run only (--cold-only)."""
    runs = [("cold", cold)] + ([("warm", warm)] if warm else [])
    header = ["program", "B x T", "pages", "HLO k chars (lowered / optimized)"] + [
        f"{w} s ({n})" for n, _ in runs for w in ("lower", "compile")]
    rows = [[c["kind"], f"{c['B']} x {c['T']}", c["pages"], "%d / %d" % tuple(n // 1000 for n in c["hlo_chars"])]
            + [fmt(r["programs"][i][w]) for _, r in runs for w in ("lower_s", "compile_s")]
            + ([warm["programs"][i]["source"]] if warm else [])
            for i, c in enumerate(cold["programs"])]
    print_table(header + (["warm"] if warm else []), rows, "lrrr" + "rr" * len(runs) + ("l" if warm else ""))
    print()
    totals = []
    for name, r in (("cold (empty cache)", cold), ("warm (cache hit)", warm)):
        if r is None:
            continue
        p = r["programs"]
        hits = sum(x["source"] == "cache hit" for x in p)
        totals.append([name, len(p), fmt(sum(x["lower_s"] for x in p)), fmt(sum(x["compile_s"] for x in p)),
                       f"{hits}/{len(p)}", fmt(r["build_s"]), fmt(r["process_s"])])
    print_table(["run", "programs", "lower s", "compile s", "cache hits", "engine build s", "process s"], totals)


# this script's own flags, dropped from the command line that `--serve` hands `dsv41 serve` (valued / switches);
# the cache directory and the port are set per run
_OWN_VALUED = ("--programs", "--lower-for", "--child", "--serve-timeout", "--server-logs", "--compilation-cache-dir",
               "--port")
_OWN_SWITCHES = ("--abstract", "--smallest", "--cold-only", "--serve", "--build")


def serve_flags(argv: list[str], args: argparse.Namespace) -> list[str]:
    """`dsv41 serve`'s flags from this command line: its own flags dropped, the preset made explicit where none is
    given (this script's default, bench, is not serve's)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _OWN_VALUED:
            skip = True
        elif a not in _OWN_SWITCHES and not a.startswith(tuple(f + "=" for f in _OWN_VALUED)):
            out.append(a)
    given = any(a == "--preset" or a.startswith("--preset=") for a in out)
    return out if args.checkpoint or given else ["--preset", args.preset, *out]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float | None:
    """The process's user + system CPU seconds so far (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _log_tail(out, chars: int = 4000) -> str:
    """The end of a server's log without the access lines of this bench's /health polls (20 a second)."""
    return "".join(line for line in out if '"GET /health"' not in line)[-chars:]


def _one_request_s(port: int) -> float:
    """Seconds of one completion of 8 tokens on a 2-token prompt, the served model's (on a staged warm-up's
    covering programs, padded, while the others compile)."""
    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - t


def _line_s(line: str) -> float | None:
    """The wall-clock time (epoch seconds) of a server log line, from its leading timestamp (`serving.cli`'s
    format: '2026-12-08 00:03:04,886 INFO ...'), or None."""
    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def serve_to_healthy(flags: list[str], cache_dir: str, timeout_s: float = 1800, log_path: str | None = None) -> dict:
    """Starts `dsv41 serve FLAGS --warmup` over the compilation cache cache_dir and polls /health until it answers
    200 and then until every program is ready (a staged warm-up's 200s say how many are), timing one short request
    (`_one_request_s`) at each -> {"healthy_s" (from the command's start), "all_s", "cpu_s" (at healthy),
    "first_request_s", "request_s", "programs" (warm-up's per-program reports, each with the seconds from the
    command's start to its log line)}; stops the server, its log (less the /health polls) to log_path if given."""
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "serving.cli", "serve", *flags, "--warmup", "--port", str(port),
           "--compilation-cache-dir", cache_dir]
    logger.info("starting %s", " ".join(cmd[2:]))
    healthy_s = cpu_s = first_request_s = None
    with tempfile.TemporaryFile("w+") as out:
        t0, start = time.perf_counter(), time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if proc.poll() is not None:
                    out.seek(0)
                    raise SystemExit(f"dsv41 serve exited ({proc.returncode}) before /health answered 200; its "
                                     f"log ends:\n{_log_tail(out)}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        body = json.loads(r.read())
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass  # not listening yet, or 503 while warming up
                else:
                    if healthy_s is None:
                        healthy_s, cpu_s = time.perf_counter() - t0, _cpu_s(proc.pid)
                        logger.info("healthy after %.1f s (%.1f CPU s)", healthy_s, cpu_s or float("nan"))
                        first_request_s = _one_request_s(port)
                    if "programs_ready" not in body:  # (a staged warm-up's other programs are in use)
                        break
                if time.perf_counter() - t0 > timeout_s:
                    out.seek(0)
                    raise SystemExit(f"dsv41 serve not {'done warming up' if healthy_s else 'healthy'} after "
                                     f"{timeout_s:.0f} s (--serve-timeout); its log ends:\n{_log_tail(out)}")
                time.sleep(0.05)
            all_s = time.perf_counter() - t0
            logger.info("every program ready after %.1f s", all_s)
            request_s = _one_request_s(port)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out.seek(0)
            log = [line for line in out if '"GET /health"' not in line]
            if log_path:  # (a failed run's too)
                with open(log_path, "w") as f:
                    f.writelines(log)
    lines = [line for line in log if parse_report_line(line) is not None]
    at = [_line_s(line) for line in lines]
    return {"healthy_s": healthy_s, "all_s": all_s, "cpu_s": cpu_s, "first_request_s": first_request_s,
            "request_s": request_s,
            "programs": [(parse_report_line(line), None if t is None else t - start) for line, t in zip(lines, at)],
            "by_workers": sum("(compile worker" in line for line in lines)}


def report_serve(cold: dict, warm: dict | None) -> None:
    """Per program (by shape: the log's order is the order compiles finished) its source, lower and compile time
    and when it was reported (seconds from the command's start) in each run, then each run's time to healthy."""
    runs = [("cold", cold)] + ([("warm", warm)] if warm else [])
    by_shape = [{(r.kind, r.B, r.T, r.pages): (r, at) for r, at in run["programs"]} for _, run in runs]
    header = ["program", "B x T", "pages"] + [f"{w} ({n})" for n, _ in runs
                                              for w in ("source", "lower s", "compile s", "reported at s")]
    rows = []
    for key in by_shape[0]:
        row = [key[0], f"{key[1]} x {key[2]}", key[3]]
        for shapes in by_shape:
            r, at = shapes.get(key, (None, None))
            row += [r.source, fmt(r.lower_s), fmt(r.compile_s), fmt(at, "{:.1f}")] if r else ["-"] * 4
        rows.append(row)
    print_table(header, rows, "lrr" + "lrrr" * len(runs))
    print()
    sources = (compile_events.COMPILED, compile_events.HIT, compile_events.STORED)
    totals = [[name, len(run["programs"]), *(sum(r.source == s for r, _ in run["programs"]) for s in sources),
               run["by_workers"], fmt(run["healthy_s"]), fmt(run["all_s"]), fmt(run["cpu_s"], "{:.1f}"),
               fmt(run["first_request_s"]), fmt(run["request_s"])]
              for name, run in (("cold (empty cache)", cold), ("warm (cache hit)", warm)) if run is not None]
    print_table(["run", "programs", "compiled", "cache hits", "stored", "by compile workers", "healthy after s",
                 "every program after s", "server CPU s (healthy)", "request at healthy s",
                 "request with every program s"], totals)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU found" on every start
    if args.child:
        child(args)  # stdout: its one JSON line; its log goes to stderr
        return 0
    if args.serve and (args.abstract or args.programs or args.smallest):
        raise SystemExit("--serve times the server as a user starts it, every program with weights allocated; "
                         "drop --abstract, --programs and --smallest")
    if args.build:
        measure_build(args)
        return 0
    if args.trace_compile:
        if not args.abstract or args.serve or args.lower_for:
            raise SystemExit("--trace-compile traces an abstract engine's compiles in this process: add --abstract, "
                             "drop --serve and --lower-for")
        jax.config.update("jax_enable_compilation_cache", False)
        measure_compile_trace(args)
        return 0
    if args.lower_for:
        if not args.abstract or args.serve:
            raise SystemExit("--lower-for lowers for another platform than this host's: add --abstract (no weights "
                             "allocated) and drop --serve")
        measure_lowering(args)
        return 0
    given = args.compilation_cache_dir
    if given and os.path.isdir(given) and os.listdir(given):
        raise SystemExit(f"--compilation-cache-dir {given} is not empty: the cold run would load from it; give an "
                         "empty or new directory (default: a fresh temporary one)")
    with tempfile.TemporaryDirectory(prefix="dsv41_bench_startup_") as tmp:
        cache_dir = given or tmp
        if args.serve:
            flags = serve_flags(argv, args)
            logs = {w: args.server_logs and os.path.join(args.server_logs, f"serve_{w}.txt") for w in ("cold", "warm")}
            if args.server_logs:
                os.makedirs(args.server_logs, exist_ok=True)
            cold = serve_to_healthy(flags, cache_dir, args.serve_timeout, logs["cold"])
            warm = None if args.cold_only else serve_to_healthy(flags, cache_dir, args.serve_timeout, logs["warm"])
            report_serve(cold, warm)
            return 0
        mode = "abstract weights" if args.abstract else "weights allocated"
        log(f"preset {args.checkpoint or args.preset} ({mode}); compilation cache {cache_dir}")
        cold = run_child(argv, "cold", cache_dir)
        warm = None if args.cold_only else run_child(argv, "warm", cache_dir)
    report(cold, warm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
