"""Host work the engine does per decode step (batch arrays, Engram hashing and row gather, sampling keys), no
device work: the part of a step that Python adds. Prints a markdown table.

    PYTHONPATH=. python scripts/bench_host_overhead.py [--batches 1,8,64]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from dsv41 import model
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import preset
from scripts.bench_engine import fake_decode_state
from serving.engine.engine import Engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ctx", type=int, default=1000)
    args = ap.parse_args()
    # host work depends on batch, pages and the Engram rows (columns x width), not on the model's other widths:
    # the tiny model with the bench preset's (= Flash's) Engram row width
    cfg = dataclasses.replace(preset("tiny"), engram_head_dim=preset("bench").engram_head_dim)
    batches = [int(x) for x in args.batches.split(",")]
    eng = Engine(cfg, P.init_params(cfg, 0), T.load_tokenizer(), model.builtin_hasher(cfg),
                 max_num_seqs=max(batches), max_model_len=4096)
    print("| batch | host prep per decode step ms (median of 50) |\n|---|---|")
    for B in batches:
        fake_decode_state(eng, B, args.ctx)
        reqs = list(eng.running.values())
        Bp = 1 << (B - 1).bit_length()

        def prep():
            eng._batch(reqs, [[r.tokens[-1]] for r in reqs], [len(r.tokens) - 1 for r in reqs], 1, Bp)
            eng._sampling(reqs, Bp)

        prep()
        ts = []
        for _ in range(50):
            t = time.perf_counter()
            prep()
            ts.append(time.perf_counter() - t)
        print(f"| {B} | {statistics.median(ts) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
