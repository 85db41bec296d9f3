"""Start-up against a persistent compilation cache, each run in its own process (jax opens the cache once per
process), on `dsv41 serve --preset tiny`'s engine with its default flags, which on the CPU is three programs (one
prefill chunk, one block-table width, one decode batch: encoder, decoder, decode). One cold compile of the three
(`dsv41 serve`'s, a module fixture on one xdist worker) is most of the file's time.

- `bench_startup.py --serve`: `dsv41 serve --warmup --compile-workers 2` compiles and stores every program in its
  compile worker processes (`serving.engine.precompile`, `serving.engine.executables`); the next process (`dsv41
  serve` again, then an engine's warm-up) loads every program from that store, traces none, and gives the same
  tokens.
- The workers compile abstract engines (ShapeDtypeStruct weights and pool): their programs are the very programs
  the allocated engine compiles. With the program store off, the allocated serve engine's `Engine.warmup()` (its
  compile threads, as `dsv41 serve --warmup` runs it) finds each in jax's cache the workers filled and loads it
  without compiling again, and requests after it compile no program of the engine.
- scripts/bench_startup.py's abstract mode compiles a program from an empty cache and reports it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_startup.py"
# the serve defaults: on the CPU one prefill chunk, one block-table width, one decode batch (encoder, decoder, decode)
FLAGS = ["--preset", "tiny"]
pytestmark = pytest.mark.xdist_group("startup")  # the tests share the module fixture's cold compile


def _run(*cmd: str, flags: list[str] = FLAGS) -> str:
    out = subprocess.run([sys.executable, *cmd, *flags], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def serve_cold_warm(tmp_path_factory):
    """(the table of `bench_startup.py --serve`: `dsv41 serve --warmup` from an empty cache, then again, that
    cache, the directory of the two servers' logs)."""
    tmp = tmp_path_factory.mktemp("serve")
    table = _run(str(SCRIPT), "--serve", "--serve-timeout", "300", "--compilation-cache-dir", str(tmp / "cache"),
                 "--server-logs", str(tmp / "logs"), flags=[*FLAGS, "--compile-workers", "2"])
    return table, tmp / "cache", tmp / "logs"


@pytest.fixture(scope="module")
def served(serve_cold_warm):
    """The allocated serve engine's run over that cache with the program store off (`_after_warmup`, its own
    process): warm-up's program sources, then what requests compiled and their tokens."""
    return _last_json(_run(__file__, "--after-warmup", str(serve_cold_warm[1]), "--no-program-store", flags=[]))


def test_abstract_equals_allocated(served):
    """The compile workers' abstract engines compiled exactly the allocated engine's programs: its warm-up finds
    every one in jax's cache (each shape's padding call made once to look for it in the store and lower it, then
    once to run it) and none "compiled again when loaded"."""
    assert sorted(served["warmup_sources"]) == [["decode", "cache hit"], ["decoder", "cache hit"],
                                                ["encoder", "cache hit"]], served
    assert served["padding_calls"] == ["encoder", "decoder", "decode", "encoder", "decoder", "decode"], served
    assert served["warmup_warnings"] == [], served


def test_abstract_compile_reports_each_program(tmp_path):
    """`bench_startup.py --abstract --cold-only`: a program of the serve engine compiled from ShapeDtypeStructs in a
    fresh process and an empty cache, with its lower and compile time (the replay decoder: the cheapest of the
    three to compile)."""
    table = _run(str(SCRIPT), "--abstract", "--cold-only", "--programs", "decoder", "--compilation-cache-dir",
                 str(tmp_path / "cache"))
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert lines[1].split("|")[1].strip() == "decoder", table
    assert any("cold (empty cache) | 1 |" in line and "| 0/1 |" in line for line in lines), table


def test_serve_cold_then_from_the_program_store(serve_cold_warm, served):
    """`dsv41 serve --warmup` compiles every program and stores it (`serving.engine.executables`); the next start
    loads each from the store, tracing none; an engine warmed up from that store gives the tokens of one whose
    programs came from jax's cache (`served`)."""
    import argparse

    import bench_startup

    table, cache, logs = serve_cold_warm
    assert bench_startup.serve_flags(["--serve", "--cold-only", "--programs", "decode", "--max-num-seqs", "4",
                                      "--port=9", "--serve-timeout", "60", "--server-logs", "logs"],
                                     argparse.Namespace(checkpoint=None, preset="tiny")) == [
        "--preset", "tiny", "--max-num-seqs", "4"]
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    programs = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[1:4]]
    # (program, source cold, source warm, warm lower s): traced for nothing the second time
    assert sorted((p[0], p[3], p[7], p[8]) for p in programs) == [
        (k, "compiled", "stored", "0.00") for k in ("decode", "decoder", "encoder")], table
    # each reported (its log line) after its own lower + compile from the command's start, and before every
    # program was ready
    every = next(float(line.split("|")[8]) for line in lines if line.startswith("| cold (empty cache) |"))
    for p in programs:
        assert float(p[4]) + float(p[5]) < float(p[6]) <= every, table
    for run in ("cold", "warm"):  # the servers' logs, less the bench's /health polls
        log = (logs / f"serve_{run}.txt").read_text()
        assert log.count("warm-up 3/3 ") == 1 and '"GET /health"' not in log, log[-2000:]
    # every program came from the compile workers (`serving.engine.precompile`); the warm start needed none: the
    # store noted that it holds every program of this engine
    assert any(line.startswith("| cold (empty cache) | 3 | 3 | 0 | 0 | 3 |") for line in lines), table
    assert any(line.startswith("| warm (cache hit) | 3 | 0 | 0 | 3 | 0 |") for line in lines), table
    again = _last_json(_run(__file__, "--after-warmup", str(cache), flags=[]))
    assert sorted(again["warmup_sources"]) == [["decode", "stored"], ["decoder", "stored"], ["encoder", "stored"]]
    assert again["warmup_warnings"] == [] and again["padding_calls"] == served["padding_calls"], again
    assert not [n for n in again["compiled_after"] if n in PROGRAM_NAMES], again
    assert again["tokens"] == served["tokens"], (served, again)


def test_serve_defaults_compile_few_programs():
    """`dsv41 serve --preset tiny` with its default flags (max_model_len 8192 = 128 pages, 8 sequences, 512-token
    chunks): the block table is one width, and on the CPU the bucket floors are the chunk and max_num_seqs
    (`EngineConfig.bucket_floors`), so warm-up compiles one encoder chunk, the replay decoder and one decode batch.
    A GPU's floors (16 tokens, 1 row) give the prefill chunk buckets and the decode batch buckets."""
    import argparse

    from serving.cli_serve import add_serve_args, build_engine
    from serving.engine.config import EngineConfig

    assert EngineConfig().bucket_floors("gpu") == (16, 1)
    assert EngineConfig().bucket_floors("cpu") == (512, 8)
    assert EngineConfig(min_prefill_bucket=64).bucket_floors("cpu") == (64, 8)  # a given floor wins

    def shapes(*flags: str):
        return build_engine(add_serve_args(argparse.ArgumentParser()).parse_args(["--preset", "tiny", *flags])
                            ).program_shapes()

    assert shapes() == [("encoder", 1, 512, 128), ("decoder", 1, 1, 128), ("decode", 8, 1, 128)]
    assert shapes("--min-prefill-bucket", "16", "--min-decode-bucket", "1") == (
        [("encoder", 1, T, 128) for T in (16, 32, 64, 128, 256, 512)] + [("decoder", 1, 1, 128)]
        + [("decode", B, 1, 128) for B in (1, 2, 4, 8)])
    # a GPU's decode step is two programs (`EngineConfig.splits_decode`): 15 programs there
    assert shapes("--split-decode")[2:] == [("decode_first", 8, 1, 128), ("decode_rest", 8, 1, 128)]


def test_lower_for_cuda_on_this_host():
    """`bench_startup.py --abstract --lower-for cuda`: the engine a GPU would build (its kernels, buckets and
    programs) traced and lowered for CUDA on this CPU host, no GPU needed: the tiny preset's GPU decode step (batch
    1, the GPU's decode floor; two programs, cut at the split layer) holds Mosaic GPU kernels."""
    table = _run(str(SCRIPT), "--abstract", "--lower-for", "cuda", "--programs", "decode", "--smallest")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("| ")]
    assert rows[0][:6] == ["program", "B x T", "pages", "trace s", "lower s", "Mosaic GPU kernels"], table
    assert [r[:3] for r in rows[1:3]] == [["decode_first", "1 x 1", "128"], ["decode_rest", "1 x 1", "128"]], table
    assert int(rows[1][5]) > 0 and int(rows[2][5]) > 0, table
    assert rows[3][0] == "programs" and rows[4][0] == "2", table


def test_requests_after_warmup_compile_no_program(served):
    """The serve engine warmed up from the module's cache, then a prompt of two chunks (the replay decoder after
    them) beside a short one, decoding together: no program of the engine compiles."""
    out = served
    assert out["program_cache_sizes"][0] == out["program_cache_sizes"][1], out
    assert not [n for n in out["compiled_after"] if n in PROGRAM_NAMES], out
    assert [len(t) for t in out["tokens"]] == [3, 3], out


PROGRAM_NAMES = {"jit(_full)", "jit(_encoder)", "jit(_decoder)", "jit(_spec)"}


def _after_warmup(cache: str, flags: list[str]) -> dict:
    """(a child process) What the requests after warm-up compiled: the jitted functions' names. flags: the serve
    flags after FLAGS."""
    import argparse
    import logging
    from unittest import mock

    import numpy as np
    from jax import monitoring

    from serving import compilation_cache
    from serving.cli_serve import add_serve_args, build_engine
    from serving.engine import compile_events
    from serving.engine.engine import SamplingParams

    compilation_cache.configure(cache)
    eng = build_engine(add_serve_args(argparse.ArgumentParser()).parse_args([*FLAGS, *flags]))
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    engine_log = logging.getLogger("serving.engine")  # warm-up's, the program store's
    engine_log.addHandler(handler)
    calls, real_call = [], eng._padding_call
    with mock.patch.object(eng, "_padding_call",
                           lambda kind, *a, **kw: calls.append(kind) or real_call(kind, *a, **kw)):
        eng.warmup(workers=2)  # the compile threads, then each program's load
    engine_log.removeHandler(handler)
    sources = [(r.kind, r.source) for r in eng.warmup_progress.reports]
    progs = eng.programs.run_encoder, eng.programs.run_decoder, eng.programs.run_full
    sizes = [[p._cache_size() for p in progs]]
    compiled = []
    monitoring.register_event_duration_secs_listener(
        lambda e, d, **kw: compiled.append(kw.get("fun_name")) if e == compile_events.BACKEND_COMPILE else None)
    rng = np.random.default_rng(0)
    for i, n in enumerate((eng.chunk + 100, 20)):
        eng.add_request(f"r{i}", rng.integers(0, 900, n).tolist(), SamplingParams(max_tokens=3, ignore_eos=True))
    tokens = {}
    while eng.has_work():
        for o in eng.step():
            tokens[o.request_id] = tokens.get(o.request_id, []) + list(o.new_token_ids)
    sizes.append([p._cache_size() for p in progs])
    return {"warmup_sources": sources, "padding_calls": calls, "warmup_warnings": warnings,
            "program_cache_sizes": sizes, "compiled_after": compiled,
            "tokens": [tokens[k] for k in sorted(tokens)]}


if __name__ == "__main__":  # the child of test_requests_after_warmup_compile_no_program
    at = sys.argv.index("--after-warmup")
    sys.stdout.write(json.dumps(_after_warmup(sys.argv[at + 1], sys.argv[at + 2:])) + "\n")


def test_build_phases(capsys):
    """`bench_startup.py --build`: the engine's construction with random weights, by phase, with the compiles each
    phase ran."""
    import bench_startup

    assert bench_startup.main(["--build", "--preset", "tiny"]) == 0
    rows = {r[0]: r[1:] for r in ([c.strip() for c in line.split("|")[1:-1]]
                                  for line in capsys.readouterr().out.splitlines() if line.startswith("| "))}
    assert list(rows)[1:] == ["backend", "weights (init_params)", "engine (kernel layouts, layers, pool)", "total"]
    # (compiles: in a process that compiled these shapes before, none)
    assert int(rows["total"][1]) >= int(rows["weights (init_params)"][1]) >= 0
