"""scripts/bench_startup.py on the tiny preset, three programs: the cold run compiles each, the warm run loads
each from the cache, and the abstract mode's programs (ShapeDtypeStruct weights and pool) are the very programs
the allocated engine compiles: the allocated engine's run finds every one in the cache the abstract runs left."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_startup.py"
# one prefill width, one block-table width, one decode width: encoder, decoder, decode
FLAGS = ["--preset", "tiny", "--max-model-len", "512", "--max-num-seqs", "2", "--max-num-batched-tokens", "128",
         "--min-prefill-bucket", "128", "--min-block-table-pages", "8", "--min-decode-bucket", "2"]


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), *FLAGS, *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_cold_then_warm_and_abstract_equals_allocated(tmp_path):
    cache = tmp_path / "cache"
    table = _run("--abstract", "--compilation-cache-dir", str(cache))
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    programs = [line.split("|")[1].strip() for line in lines[1:4]]
    assert programs == ["encoder", "decoder", "decode"] and all(line.endswith("| cache hit |") for line in lines[1:4])
    assert any("cold (empty cache) | 3 |" in line and "| 0/3 |" in line for line in lines), table
    assert any("warm (cache hit) | 3 |" in line and "| 3/3 |" in line for line in lines), table
    allocated = json.loads(_run("--child", "warm", "--compilation-cache-dir", str(cache)).strip().splitlines()[-1])
    assert [p["source"] for p in allocated["programs"]] == ["cache hit"] * 3
