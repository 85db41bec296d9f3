"""Host work the engine does per decode step, no device work: the part of a step that Python adds. Prints a
markdown table with two columns per (context, batch):

- host prep: `Engine.decode_inputs` (batch arrays and block tables, Engram hashing and row gather, sampling keys);
- whole step on the host: `Engine.step()` with the jitted program replaced by a stub that returns a token at
  once, i.e. everything the engine thread does between two device steps (scheduling, page accounting, the
  inputs, accepting the sampled tokens).

    PYTHONPATH=. python scripts/bench_host_overhead.py [--batches 1,8,64] [--contexts 1000,100000]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from dsv41 import model
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import preset
from scripts.bench_engine import fake_decode_state
from serving.engine import programs
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine


def _median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="1000,100000")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    page_tokens = 64
    max_len = -(-(max(contexts) + 2 * args.reps + 8) // page_tokens) * page_tokens
    # host work depends on batch, context (pages) and the Engram rows (columns x width), not on the model's
    # other widths: the tiny model with the bench preset's (= Flash's) Engram row width
    cfg = dataclasses.replace(preset("tiny"), engram_head_dim=preset("bench").engram_head_dim,
                              max_seq_len=max(max_len, preset("tiny").max_seq_len))
    eng = Engine(cfg, P.init_params(cfg, 0), T.load_tokenizer(), model.builtin_hasher(cfg),
                 config=EngineConfig(max_num_seqs=max(batches), max_model_len=max_len, page_tokens=page_tokens,
                 num_pages=max(batches) * (max_len // page_tokens)))

    def stub(params, pool, b, s, **kw):
        return pool, None, np.full(b.tokens.shape[0], 7, np.int32)

    programs.run_full = stub  # this process only times the host side
    print("| context | batch | host prep ms | whole step on the host ms |\n|---|---|---|---|")
    for ctx in contexts:
        for B in batches:
            fake_decode_state(eng, B, ctx)
            prep = _median_ms(lambda: eng.decode_inputs(list(eng.running.values())), args.reps)
            step = _median_ms(eng.step, args.reps)
            print(f"| {ctx} | {B} | {prep:.3f} | {step:.3f} |")


if __name__ == "__main__":
    main()
