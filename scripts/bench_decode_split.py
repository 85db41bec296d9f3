"""The decode step cut in two programs at the replay split layer (layers [0, split) with the embedding, then
[split, L) with the head), against the one program the engine runs: what the cut would buy at start-up and at
every step, before the engine is changed for it.

    PYTHONPATH=. python3 scripts/bench_decode_split.py [--preset tiny] [--batches 1,64] [--backends auto]

Why (docs/PERFORMANCE.md): on the H200 the host launches the decode program's CUDA graph (~660 kernels, 1.4 ms in
`cuGraphLaunch` at batch 1) before the GPU starts any of it (section 2), so a step is launch + work in series; cut
in two, the GPU runs the first part while the host launches the second. At start-up the 8-row decode program is
the longest compile on the way to a healthy server (section 6); two parts would compile side by side in two compile
workers.

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
import statistics
import subprocess
import sys
import time

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import numpy as np

from dsv41 import model
from dsv41 import params as P
from dsv41.config import preset
from serving.engine import programs
from serving.engine.backends import Backends
from serving.engine.engine import Engine
from timing import fake_decode_state, make_engine, print_table

log = logging.getLogger("bench_decode_split")


def _first(params, pool, b, *, cfg, num, backends=Backends()):
    """Embedding and layers [0, split) -> (pool, stream [B, 1, hc, D], pre-mix [B, 1, hc])."""
    h, pre = model.embed(params, b.tokens, cfg, num)
    h, pre, pool = programs._layers(params, pool, b, h, pre, cfg, num, 0, cfg.split_layer, {}, backends)
    return pool, h, pre


def _rest(params, pool, b, h, pre, *, cfg, num, backends=Backends()):
    """Layers [split, L) and the head -> (pool, logits [B, V], their argmax [B]). The split layer starts a fresh
    indexer carry (as the replay decoder's program does), so nothing else crosses the cut."""
    h, pre, pool = programs._layers(params, pool, b, h, pre, cfg, num, cfg.split_layer, cfg.n_layers, {}, backends)
    logits, tok = programs._head(params, h, pre, b, cfg)
    return pool, logits, tok


FIRST = programs._program("decode_first", _first, programs._STATIC)
REST = programs._program("decode_rest", _rest, programs._STATIC)


def compile_child(args) -> None:
    """One program (--compile whole|first|rest) at batch args.batches, lowered and compiled from an abstract
    engine in this fresh process: prints {"lower_s", "compile_s"}."""
    B, cfg = int(args.batches), preset(args.preset)
    # `steps`' engine's configuration (`timing.make_engine`)
    eng = Engine.abstract(cfg, timing.engine_config(cfg, True, args.max_model_len, B, args.backend))
    prog, a, static = eng._padding_call("decode", B, 1, eng.max_pages_per_seq)
    if args.compile != "whole":
        prog = FIRST
        if args.compile == "rest":
            _, h, pre = jax.eval_shape(lambda *x: FIRST(*x, **static), *a)
            prog, a = REST, (*a, h, pre)
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

    def whole():
        eng.pool, logits, tok = programs.run_full(eng.params, eng.pool, b, **eng.static)
        return logits, np.asarray(tok)  # the engine reads the tokens back every step

    def split():
        eng.pool, h, pre = FIRST(eng.params, eng.pool, b, **eng.static)
        eng.pool, logits, tok = REST(eng.params, eng.pool, b, h, pre, **eng.static)
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
        c, s = compile_times(args, B), steps(args, cfg, params, B)
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
