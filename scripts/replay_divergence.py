"""How far SWA bounded replay moves the model from the exact path, by prompt length (tiny preset, CPU): the same
prompt through the engine with replay off (all layers on every prompt token) and on (the decoder layers see the
last `window` prompt tokens), then greedy tokens; float32 activations with the serving KV formats, so the
differences are replay's, not bf16 noise. Prints the markdown table of docs/REPLAY.md.

    PYTHONPATH=. python scripts/replay_divergence.py [--lengths 256,512,1024,2048,4096] [--tokens 64]
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from dsv41 import model, quant
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import preset
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine, SamplingParams

NUM = quant.Numerics(act_quant=False, bf16_probs=False, dtype="float32")


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = preset("tiny")
    params = P.dequantize_params(P.init_params(cfg, seed=0), "float32")
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + args.tokens + 64
    engines = {
        rep: Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg), config=EngineConfig(max_num_seqs=1,
                    max_model_len=max_len, max_num_batched_tokens=512, swa_bounded_replay=rep,
                    enable_prefix_caching=False, numerics=NUM, keep_logits=True, min_prefill_bucket=512))
        for rep in (False, True)
    }
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rows = []
    for n in lengths:
        stats = []
        for seed in range(args.seeds):
            ids = list(np.random.default_rng(100 + seed).integers(3, cfg.vocab_size, n))
            out = {}
            for rep, eng in engines.items():
                t = time.perf_counter()
                rid = f"{n}-{seed}-{rep}"
                eng.add_request(rid, ids, sp)
                toks = []
                while eng.has_work():
                    for o in eng.step():
                        toks += o.new_token_ids
                out[rep] = (toks, np.stack(eng.finished_logits.pop(rid)))
                logging.info("n=%d seed=%d replay=%s %.1fs", n, seed, rep, time.perf_counter() - t)
            (te, le), (tr, lr) = out[False], out[True]
            first = le[0], lr[0]
            lp, lq = log_softmax(first[0].astype(np.float64)), log_softmax(first[1].astype(np.float64))
            kl = float((np.exp(lp) * (lp - lq)).sum())
            agree = np.mean(np.array(te) == np.array(tr))
            div = next((i for i, (a, b) in enumerate(zip(te, tr)) if a != b), len(te))
            stats.append((float(np.abs(first[0] - first[1]).max()), kl, agree, div))
        s = np.array(stats)
        rows.append((n, s[:, 0].max(), s[:, 1].mean(), s[:, 2].mean(), s[:, 3].min()))
    print(f"\ntiny preset (window {cfg.window_size}), float32 activations + serving KV formats, "
          f"{args.seeds} prompts per length, {args.tokens} greedy tokens\n")
    print("| prompt tokens | max |logit error| (1st token) | KL(exact || replay) (1st token) | "
          "greedy agreement | first divergence (min) |")
    print("|---|---|---|---|---|")
    for n, e, kl, a, d in rows:
        print(f"| {n} | {e:.3g} | {kl:.3g} | {100 * a:.0f}% | {int(d)} |")


if __name__ == "__main__":
    main()
