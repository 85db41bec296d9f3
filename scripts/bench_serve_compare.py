#!/usr/bin/env python3
"""`dsv41 bench serve` against several `dsv41 serve` variants, one after the other, in one table and one pair
of plots (e.g. SWA bounded replay on vs off).

Each variant starts its own server (a subprocess, warm-up on so that no request waits for a compile), waits for
/health, runs the agentic multi-turn load of `serving/bench.py` at every concurrency level, and stops it. The
persistent compilation cache is shared, so programs common to two variants compile once.

  python scripts/bench_serve_compare.py --out results/ --preset bench \\
      --variant replay= --variant exact=--no-swa-bounded-replay \\
      --server-args "--max-model-len 8192 --max-num-seqs 8" --bench-args "--max-concurrency 1,4,8"

Writes <out>/<variant>.json (the bench reports), <out>/throughput_vs_interactivity.png, <out>/ttft_vs_load.png
and <out>/summary.md (the table), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from serving.bench import write_plots  # noqa: E402

log = logging.getLogger("bench_serve_compare")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s")


def run_variant(name: str, extra: list[str], args, out: pathlib.Path) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--preset", args.preset, "--port", str(port),
           "--warmup", *shlex.split(args.server_args), *extra]
    log.info("[%s] %s", name, " ".join(cmd))
    logf = open(out / f"{name}.server.log", "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=args.cwd)
    try:
        ready_s = _wait_healthy(url, proc, args.start_timeout)
        log.info("[%s] healthy after %.1f s (load + warm-up)", name, ready_s)
        with tempfile.TemporaryDirectory() as tmp:
            bcmd = [sys.executable, "-m", "serving.cli", "bench", "serve", "--base-url", url, "--result-dir", tmp,
                    *shlex.split(args.bench_args)]
            log.info("[%s] %s", name, " ".join(bcmd))
            rc = subprocess.run(bcmd, cwd=args.cwd).returncode
            report = json.loads((pathlib.Path(tmp) / "bench_serve.json").read_text())
        report["server_ready_s"] = ready_s
        report["bench_rc"] = rc
        report["server_command"] = cmd
        (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
        return report
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()


def table(reports: dict[str, dict]) -> str:
    lines = ["| variant | concurrency | requests ok/failed | output tok/s | total tok/s | prefix hit (later turns) | "
             "TTFT p50 / p90 ms | TPOT p50 ms | ITL p50 / p90 ms | e2e p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rep in reports.items():
        for s in rep["levels"]:
            lines.append(
                f"| {name} | {s['max_concurrency']} | {s['requests_ok']}/{s['requests_failed']} | "
                f"{s['output_tokens_per_s']:.1f} | {s['total_tokens_per_s']:.0f} | "
                f"{s['prefix_hit_rate']:.2f} ({s['prefix_hit_rate_later_turns']:.2f}) | "
                f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p90']:.0f} | {s['tpot_ms']['p50']:.1f} | "
                f"{s['itl_ms']['p50']:.1f} / {s['itl_ms']['p90']:.1f} | {s['e2e_ms']['p50']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=EXTRA SERVER FLAGS (e.g. exact=--no-swa-bounded-replay); repeat per variant")
    ap.add_argument("--server-args", default="", help="flags every server gets")
    ap.add_argument("--bench-args", default="", help="flags of `dsv41 bench serve`")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--cwd", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for v in args.variant:
        name, _, extra = v.partition("=")
        try:
            reports[name] = run_variant(name, shlex.split(extra), args, out)
        except Exception as e:  # one variant failing keeps the others' numbers
            log.exception("[%s] failed: %s", name, e)
    if not reports:
        return 1
    md = table(reports)
    (out / "summary.md").write_text(md + "\n")
    print(md)
    write_plots({n: r["levels"] for n, r in reports.items()}, out, title=args.preset + " preset")
    return 0 if len(reports) == len(args.variant) else 1


if __name__ == "__main__":
    raise SystemExit(main())
