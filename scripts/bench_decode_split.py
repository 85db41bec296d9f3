"""The decode step cut in two programs at the replay split layer (`EngineConfig.split_decode`, a GPU's default:
`programs.run_decode_first`, layers [0, split) with the embedding, then `run_decode_rest`, [split, L) with the
head), against the one program (`run_full`): what the cut buys at start-up and costs at every step.

    PYTHONPATH=. python3 scripts/bench_decode_split.py [--preset tiny] [--batches 1,64] [--backend auto]
        [--no-compile-times]

Why (docs/PERFORMANCE.md): at start-up the 8-row decode program was the longest compile on the way to a healthy
server (section 6); its two parts compile side by side in two compile workers. On the H200 the host launches the
decode program's CUDA graph (~660 kernels, 1.4 ms in `cuGraphLaunch` at batch 1) before the GPU starts any of it
(section 2); cut in two, the GPU can run the first part while the host launches the second.

Per configuration and batch: each program's lower and compile time, each in a fresh process from an abstract
engine (jaxlib compiles a Mosaic GPU kernel once a process, and the parts share kernels with the whole); then the
step's wall time through the engine's call path (host arrays in one transfer, tokens read back each step as the
engine's loop does), the one program and the two alternated, medians; and the largest logit difference between
them (the same operations, fused apart at the cut), with the greedy tokens, which must agree.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import subprocess
import sys
import time

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import numpy as np

from dsv41 import params as P
from dsv41.config import preset
from serving.engine import programs
from serving.engine.engine import Engine
from timing import fake_decode_state, make_engine, print_table

log = logging.getLogger("bench_decode_split")
KINDS = {"whole": "decode", "first": "decode_first", "rest": "decode_rest"}  # `Engine.program_shapes`' kinds


def compile_child(args) -> None:
    """One program (--compile whole|first|rest) at batch args.batches, lowered and compiled from an abstract
    engine in this fresh process, as a compile worker does: prints {"lower_s", "compile_s"}."""
    B, cfg = int(args.batches), preset(args.preset)
    # `steps`' engine's configuration (`timing.make_engine`)
    config = timing.engine_config(cfg, True, args.max_model_len, B, args.backend, split_decode=args.compile != "whole")
    eng = Engine.abstract(cfg, config)
    prog, a, static = eng._padding_call(KINDS[args.compile], B, 1, eng.max_pages_per_seq)
    t0 = time.perf_counter()
    lowered = prog.lower(*a, **static)
    t1 = time.perf_counter()
    lowered.compile()
    print(json.dumps({"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}))


def compile_times(args, B: int) -> dict:
    out = {}
    for which in ("whole", "first", "rest"):
        cmd = [sys.executable, __file__, "--compile", which, "--batches", str(B), "--preset", args.preset,
               "--backend", args.backend, "--max-model-len", str(args.max_model_len)]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        out[which] = json.loads(res.stdout.strip().splitlines()[-1])
        log.info("B=%d %s: lower %.1f s, compile %.1f s", B, which, out[which]["lower_s"], out[which]["compile_s"])
    return out


def steps(args, cfg, params, B: int) -> dict:
    """Step wall times (ms), whole against split, alternated; their logits' largest difference and tokens."""
    eng = make_engine(cfg, params, True, args.max_model_len, B, args.backend)
    fake_decode_state(eng, B, args.decode_ctx)
    b, _ = eng.decode_inputs(list(eng.running.values()))
    progs = eng.programs

    def whole():
        eng.pool, logits, tok = progs.run_full(eng.params, eng.pool, b, **eng.static)
        return logits, np.asarray(tok)  # the engine reads the tokens back every step

    def split():
        eng.pool, h, pre = progs.run_decode_first(eng.params, eng.pool, b, **eng.static)
        eng.pool, logits, tok = progs.run_decode_rest(eng.params, eng.pool, programs.rest_batch(b, cfg), h, pre,
                                                      **eng.static)
        return logits, np.asarray(tok)

    # (the pool is rewritten with the same KV each call: the step is the same every time)
    (lw, tw), (ls, ts) = whole(), split()
    lw, ls = np.asarray(lw, np.float32), np.asarray(ls, np.float32)
    times = {"whole": [], "split": []}
    for _ in range(args.steps):
        for name, fn in (("whole", whole), ("split", split)):
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {"whole_ms": statistics.median(times["whole"]), "split_ms": statistics.median(times["split"]),
            "rel_diff": float(np.abs(lw - ls).max() / np.abs(lw).max()), "same_tokens": bool(np.array_equal(tw, ts))}


def main():
    ap = timing.engine_args(__doc__, batches="1,64", weights=False)  # the release's formats, as the abstract engine
    ap.add_argument("--backend", default="auto", help="kernel configuration (scripts/timing.py's KERNELS)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20, help="steps of each kind, alternated")
    ap.add_argument("--no-compile-times", action="store_true", help="time the steps only")
    ap.add_argument("--compile", choices=["whole", "first", "rest"], help=argparse.SUPPRESS)  # a child's program
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.compile:
        return compile_child(args)
    cfg = preset(args.preset)
    params = P.init_params(cfg, seed=0)
    log.info("%s preset, split at layer %d of %d, %s", args.preset, cfg.split_layer, cfg.n_layers,
             jax.devices()[0].device_kind)
    rows, out = [], {}
    for B in (int(x) for x in args.batches.split(",")):
        c = ({w: {"lower_s": math.nan, "compile_s": math.nan} for w in ("whole", "first", "rest")}
             if args.no_compile_times else compile_times(args, B))
        s = steps(args, cfg, params, B)
        log.info("B=%d steps: %s", B, s)
        out[B] = {"compile": c, **s}
        part = max(c["first"]["lower_s"] + c["first"]["compile_s"], c["rest"]["lower_s"] + c["rest"]["compile_s"])
        rows.append([B, *(f"{c[w]['lower_s']:.1f} + {c[w]['compile_s']:.1f}" for w in ("whole", "first", "rest")),
                     f"{part:.1f}", f"{s['whole_ms']:.2f}", f"{s['split_ms']:.2f}",
                     f"{s['split_ms'] / s['whole_ms']:.3f}", f"{s['rel_diff']:.2e}", s["same_tokens"]])
    print_table(["batch", "whole: lower + compile s", "first part", "second part", "longer part s (workers side "
                 "by side)", "step ms, whole", "step ms, split", "split : whole", "logits rel. max diff",
                 "same tokens"], rows)
    timing.write_json(args.out, "bench_decode_split.json", out)


if __name__ == "__main__":
    main()
