"""Start-up against a persistent compilation cache, each run in its own process (jax opens the cache once per
process), on the tiny preset's `dsv41 serve` engine with three programs (one prefill width, one block-table width,
one decode width: encoder, decoder, decode). One cold compile serves the whole file (a module fixture, one xdist
worker): a CPU compile of the three is most of its time.

- scripts/bench_startup.py: the cold run compiles each program, the warm run loads each from the cache, and the
  abstract mode's programs (ShapeDtypeStruct weights and pool) are the very programs the allocated engine
  compiles: the allocated engine's run finds every one in the cache the abstract runs left.
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
# one prefill width, one block-table width, one decode width: encoder, decoder, decode
FLAGS = ["--preset", "tiny", "--max-model-len", "512", "--max-num-seqs", "2", "--max-num-batched-tokens", "128",
         "--min-prefill-bucket", "128", "--min-decode-bucket", "2"]
pytestmark = pytest.mark.xdist_group("startup")  # the tests share the module fixture's cold compile


def _run(*cmd: str) -> str:
    out = subprocess.run([sys.executable, *cmd, *FLAGS], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory):
    """(the table of `bench_startup.py --abstract` from an empty cache, that cache: the three programs)."""
    cache = tmp_path_factory.mktemp("startup") / "cache"
    return _run(str(SCRIPT), "--abstract", "--compilation-cache-dir", str(cache)), cache


def test_cold_then_warm_and_abstract_equals_allocated(bench_cache):
    table, cache = bench_cache
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    programs = [line.split("|")[1].strip() for line in lines[1:4]]
    assert programs == ["encoder", "decoder", "decode"] and all(line.endswith("| cache hit |") for line in lines[1:4])
    assert any("cold (empty cache) | 3 |" in line and "| 0/3 |" in line for line in lines), table
    assert any("warm (cache hit) | 3 |" in line and "| 3/3 |" in line for line in lines), table
    allocated = _last_json(_run(str(SCRIPT), "--child", "warm", "--compilation-cache-dir", str(cache)))
    assert [p["source"] for p in allocated["programs"]] == ["cache hit"] * 3


def test_serve_defaults_compile_few_programs():
    """`dsv41 serve --preset tiny` with its default flags (max_model_len 8192 = 128 pages, 8 sequences, 512-token
    chunks): the block table is one width, so warm-up compiles the prefill chunk buckets, the replay decoder and
    the decode batch buckets, 11 programs (88 when each also came in every block-table width up to 128 pages)."""
    import argparse

    from serving.cli_serve import add_serve_args, build_engine

    eng = build_engine(add_serve_args(argparse.ArgumentParser()).parse_args(["--preset", "tiny"]))
    shapes = eng.program_shapes()
    assert shapes == ([("encoder", 1, T, 128) for T in (16, 32, 64, 128, 256, 512)] + [("decoder", 1, 1, 128)]
                      + [("decode", B, 1, 128) for B in (1, 2, 4, 8)])
