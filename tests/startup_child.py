"""Run by tests/test_startup.py in a fresh process (jax opens its persistent compilation cache once per process):
the engine of `dsv41 serve`'s flags argv[1:] (with --compilation-cache-dir) warms up against that cache, serves one
request, and prints one JSON line: the programs warm-up reported and what the request compiled afterwards."""

import argparse
import json
import sys

import numpy as np

from serving import cli_serve, compilation_cache

args = cli_serve.add_serve_args(argparse.ArgumentParser()).parse_args(sys.argv[1:])
compilation_cache.configure(compilation_cache.dir_from_args(args))

from serving.engine import compile_events, programs  # noqa: E402
from serving.engine.engine import SamplingParams  # noqa: E402

eng = cli_serve.build_engine(args)
shapes = eng.warmup()
jits = (programs.run_full, programs.run_encoder, programs.run_decoder)
before = [p._cache_size() for p in jits]
eng.add_request("r", list(np.random.default_rng(8).integers(3, 1000, 200)), SamplingParams(max_tokens=4, ignore_eos=True))
with compile_events.capture() as after:
    tokens = [t for _ in iter(eng.has_work, False) for o in eng.step() for t in o.new_token_ids]
print(json.dumps({"programs": len(shapes), "expected": len(eng.program_shapes()),
                  "sources": [r.source for r in eng.warmup_progress.reports], "tokens": len(tokens),
                  "new_jit_entries": sum(p._cache_size() for p in jits) - sum(before),
                  "compiles_after": after.backend_compiles, "after_source": after.source}))
