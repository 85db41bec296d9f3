"""Where does a run with the FP8 linear kernel first choose differently from the XLA path, and was it a tie?

`compare_engine_runs.py` showed the engine's logits moving by 0.36 (relative) at the third decode step with the
kernel, and two runs with the kernel differing from each other. This runs the full-sequence model with a trace
(`model.forward_with_trace`) once per configuration and compares each run with the first through
`dsv41.trace_diff`: the first discrete choice that differs (indexer top-k, candidate blocks, routed experts),
whether its scores tie, and how far the block outputs and logits had moved before it. A prompt of 128 tokens
runs every linear at 128 rows, the replay program's trimmed batch, where the kernel splits K with float32
partials; 64 tokens, a decode batch's rows. Longer prompts run every linear on XLA (the kernel takes up to
`fp8_linear.MAX_ROWS` rows). Each run is also compared with the earlier run of its backend: a deterministic path
repeats bit for bit.

    PYTHONPATH=. python3 scripts/trace_flips.py --runs xla,xla,pallas,pallas --tokens 128,64
    PYTHONPATH=. python3 scripts/trace_flips.py --preset tiny --runs xla,interpret --tokens 64   # CPU
"""

from __future__ import annotations

import argparse
import logging

import jax
import numpy as np

from compare_engine_runs import NUM  # the same numerics as the engine comparison
from dsv41 import model, moe, trace_diff
from dsv41 import params as P
from dsv41.config import preset
from dsv41.ops import XLA
from serving.engine import backends

log = logging.getLogger("trace_flips")
KEEP = ("topk", "candidates", "moe.experts", "index_scores", "ffn_in", "block_out")


def run(params, cfg, ids, ops=XLA) -> dict:
    logits, trace = model.forward_with_trace(params, cfg, ids, NUM, ops=ops)
    out = {k: np.asarray(v) for k, v in trace.items() if k.split(".", 1)[1] in KEEP}
    out["logits"] = np.asarray(logits, np.float32)
    return out


def scores_of(trace: dict, params: dict, cfg) -> trace_diff.ScoresFn:
    """Index scores from the trace; the router's biased scores recomputed from the traced MoE input."""
    index = trace_diff.index_scores(trace)

    def get(layer, name, row, pos):
        if name != "moe.experts":
            return index(layer, name, row, pos)
        x = trace[f"layer{layer}.ffn_in"][row, pos][None]
        return np.asarray(moe.router_scores(x, params["layers"][layer]["ffn"]["gate"], cfg)[1][0])
    return get


def rel_before(a: np.ndarray, b: np.ndarray, stop: int) -> float:
    """max |a - b| / max |a| over positions [0, stop) of row 0."""
    a, b = a[0, :stop].astype(np.float32), b[0, :stop].astype(np.float32)
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) if stop else 0.0


def _fmt(scores, ids) -> str:
    return "-" if scores is None else str([float(f"{v:.6g}") for v in np.asarray(scores, np.float64)[ids]])


def _against_earlier(runs: list[str], traces: list[dict], i: int, n_layers: int) -> str:
    """Is run i bit-identical to the last earlier run with the same backend (a deterministic path must be)?"""
    same = [j for j in range(i) if runs[j] == runs[i]]
    if not same:
        return "-"
    j = same[-1]
    differing = [k for k in traces[i] if not np.array_equal(traces[i][k], traces[j][k])]
    if not differing:
        return f"identical to run {j}"
    flips = trace_diff.first_flips(traces[j], traces[i], n_layers)
    first = f"first flip {flips[0].layer}, {flips[0].name}, {flips[0].pos}" if 0 in flips else "no flip"
    logits = rel_before(traces[j]["logits"], traces[i]["logits"], traces[i]["logits"].shape[1])
    return (f"differs from run {j} in {len(differing)} of {len(traces[i])} arrays (first: {sorted(differing)[0]}); "
            f"logits rel. max diff {logits:.2e}; {first}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="xla,xla,pallas,pallas",
                    help="linear backend of each run: xla, pallas (the FP8 linear kernel), interpret (its "
                         "interpreter, CPU)")
    ap.add_argument("--tokens", default="128,64", help="prompt lengths (one batch row each)")
    ap.add_argument("--preset", default="bench")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = preset(args.preset)
    params = P.init_params(cfg, seed=0)  # the release's formats: FP8 linears, FP4 experts
    prepared = {}

    def params_of(backend):
        if backend == "xla":
            return params
        if backend not in prepared:
            prepared[backend] = backends.prepare_linears(params, cfg, interpret=backend == "interpret")
        return prepared[backend]

    runs = args.runs.split(",")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.preset} preset, runs {runs}\n")
    print("| tokens | run | first flip vs run 0 (layer, selection, position) | kept only by run 0 / only by this "
          "run | their scores in run 0 | in this run | block outputs before it, rel. max diff | logits before it | "
          "against the earlier run of its backend |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(t) for t in args.tokens.split(",")):
        ids = np.random.default_rng(4).integers(3, cfg.vocab_size, (1, n)).astype(np.int32)
        traces = []
        for be in runs:
            traces.append(run(params_of(be), cfg, ids, XLA if be == "xla" else backends.kernel_ops(linears=True)))
            log.info("tokens %d run %s done", n, be)
        ref = traces[0]
        for i, (be, tr) in enumerate(zip(runs, traces)):
            if i == 0:
                continue
            flips = trace_diff.first_flips(ref, tr, cfg.n_layers, scores_of(ref, params, cfg))
            stop = int(trace_diff.compared_prefix(flips, 1, n)[0])
            blocks = max(rel_before(ref[f"layer{j}.block_out"], tr[f"layer{j}.block_out"], stop)
                         for j in range(cfg.n_layers))
            logits = rel_before(ref["logits"], tr["logits"], stop)
            where, kept, sa, sb = "none", "-", "-", "-"
            if 0 in flips:
                f = flips[0]
                where, kept = f"{f.layer}, {f.name}, {f.pos}", f"{f.a_only.tolist()} / {f.b_only.tolist()}"
                swapped = np.concatenate([f.a_only, f.b_only])
                # a tie: equal scores in run 0; scores that moved a lot between runs: a quantization bin
                # (FP8 / MXFP4 keys, bf16 scores) flipped upstream
                sa, sb = (_fmt(fn(f.layer, f.name, 0, f.pos), swapped) for fn in
                          (scores_of(ref, params, cfg), scores_of(tr, params, cfg)))
            print(f"| {n} | {i} {be} | {where} | {kept} | {sa} | {sb} | {blocks:.2e} | {logits:.2e} | "
                  f"{_against_earlier(runs, traces, i, cfg.n_layers)} |")


if __name__ == "__main__":
    main()
