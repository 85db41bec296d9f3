"""Warm-up of the tiny test engine against a fresh persistent compilation cache, each run in its own process
(jax opens the cache once per process): the first run compiles every program of `program_shapes()` and the
first request compiles no program after it; the second run loads every program from the cache, and what the
first request still compiles outside the programs (eager ops of the prefill hand-off) comes from it too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pathlib

from serving.engine import compile_events

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _warm_up(cache_dir) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "startup_child.py"), str(cache_dir)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_warm_cache_loads_every_program(tmp_path):
    cold = _warm_up(tmp_path)
    assert cold["programs"] == cold["expected"] == 3  # tiny_engine.BASE: one prefill, decoder, decode width
    assert cold["sources"] == [compile_events.COMPILED] * 3
    assert cold["tokens"] == 4 and cold["new_jit_entries"] == 0  # the request called only warmed programs
    warm = _warm_up(tmp_path)
    assert warm["sources"] == [compile_events.HIT] * 3
    assert warm["tokens"] == 4 and warm["new_jit_entries"] == 0
    assert warm["after_source"] in (compile_events.HIT, compile_events.IN_MEMORY)  # nothing compiled
