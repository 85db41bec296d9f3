"""Is a logit difference between two engine configurations the kernels' error or the model's own sensitivity?
Runs the engine on one prompt several times (bench preset, FP8 activation quantization off as in
tests/test_engine_gpu.py) and prints, per decode step, the relative max logit difference of every run against
the first, and each step's top-2 logit gap. Two runs of the same configuration show the path's own
nondeterminism (GPU scatter-add order).

    PYTHONPATH=. python3 scripts/compare_engine_runs.py --runs xla,xla,pallas --steps 4
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from dsv41 import model
from dsv41 import params as P
from dsv41 import quant
from dsv41 import tokenizer as T
from dsv41.config import preset
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine, SamplingParams

NUM = quant.Numerics(act_quant=False, bf16_probs=True, dtype="bfloat16")


def run(cfg, params, ids, steps, linear_backend):
    eng = Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg),
                 config=EngineConfig(max_num_seqs=1, max_model_len=2048,
                 max_num_batched_tokens=2048, enable_prefix_caching=False, numerics=NUM, keep_logits=True,
                 min_prefill_bucket=2048, min_ctx_pages=32, linear_backend=linear_backend))
    toks = []
    eng.add_request("r", ids, SamplingParams(max_tokens=steps, ignore_eos=True))
    while eng.has_work():
        for o in eng.step():
            toks += o.new_token_ids
    return toks, np.stack(eng.finished_logits["r"]).astype(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="xla,xla,pallas", help="linear backend of each run")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--preset", default="bench")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = preset(args.preset)
    params = P.init_params(cfg, seed=0)
    ids = list(np.random.default_rng(4).integers(3, cfg.vocab_size, args.prompt))
    runs = [(be, *run(cfg, params, ids, args.steps, be)) for be in args.runs.split(",")]
    _, t0, l0 = runs[0]
    top2 = np.sort(l0, -1)[:, -2:]
    print("| run | tokens | rel. max logit difference vs run 0, per step |")
    print("|---|---|---|")
    for i, (be, t, lg) in enumerate(runs):
        rel = [float(np.abs(l0[s] - lg[s]).max() / np.abs(l0[s]).max()) for s in range(len(lg))]
        print(f"| {i} {be} | {t} | {np.round(rel, 4).tolist()} |")
    gap = [round(float(v), 4) for v in top2[:, 1] - top2[:, 0]]
    print(f"run 0 top-2 logit gap per step: {gap}; max |logit| {[round(float(v), 2) for v in np.abs(l0).max(-1)]}")


if __name__ == "__main__":
    main()
