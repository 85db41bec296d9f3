"""What SWA bounded replay costs in fidelity, teacher-forced (docs/REPLAY.md): a random prompt of each length and
one fixed continuation, scored by the exact path (replay off) and by replay with each `--replay-tokens` N, every
path fed the same continuation tokens (not its own samples) so position i's next-token distributions compare like
for like. Beside them the exact path's own noise floor: its serving numerics (REFERENCE) against float32
(EXACT_F32), and batch 1 against the batch of all prompts. Each path runs its prompts in one engine (decode batch
8, one program per kind), so the exact and replay engines decode the same rows in the same steps.

    PYTHONPATH=. python scripts/replay_divergence.py [--preset tiny40] [--lengths 256,...,8192]
        [--replay-tokens 128,256] [--batch1-lengths 1024] [--tokens 64]
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
from timing import print_table

log = logging.getLogger("replay_divergence")


class TeacherForced(Engine):
    """Accepts each request's given continuation in place of the token it sampled: every path then scores the
    same text, and logits[i] is the distribution of continuation token i."""

    forced: dict[str, list[int]]

    def _accept(self, r, tok):
        return super()._accept(r, self.forced[r.id][len(r.output)])


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, other: np.ndarray) -> tuple[float, float, float, float]:
    """[positions, V] logits -> mean KL(ref || other), max KL, KL at position 0, max |logit difference|."""
    lp, lq = log_softmax(ref), log_softmax(other)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return float(kl.mean()), float(kl.max()), float(kl[0]), float(np.abs(ref - other).max())


def score(eng: TeacherForced, jobs: dict[str, tuple[list[int], list[int]]], together: bool) -> dict[str, np.ndarray]:
    """jobs: id -> (prompt, continuation). together: all in one engine batch; else one after another (batch 1)."""
    out = {}
    for group in ([list(jobs)] if together else [[rid] for rid in jobs]):
        for rid in group:
            prompt, cont = jobs[rid]
            eng.forced[rid] = cont
            eng.add_request(rid, prompt, SamplingParams(max_tokens=len(cont), ignore_eos=True))
        while eng.has_work():
            eng.step()
        for rid in group:
            out[rid] = np.stack(eng.finished_logits.pop(rid))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny40")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--tokens", type=int, default=64, help="continuation length (teacher-forced positions)")
    ap.add_argument("--replay-tokens", default="128,256", help="swa_replay_tokens values to compare")
    ap.add_argument("--batch1-lengths", default="1024", help="lengths rerun at batch 1 for the batch noise floor")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t_all = time.perf_counter()
    cfg = preset(args.preset)
    params = P.init_params(cfg, args.seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    replay_ns = [int(x) for x in args.replay_tokens.split(",")]
    b1 = [int(x) for x in args.batch1_lengths.split(",") if x]
    if len(lengths) > 8:
        raise SystemExit(f"{len(lengths)} lengths: at most 8 (one engine batch); split the run")
    max_len = max(lengths) + args.tokens
    pages = -(-max_len // 64)
    rng = np.random.default_rng(1000 + args.seed)
    cont = [int(t) for t in rng.integers(3, cfg.vocab_size, args.tokens)]
    jobs = {f"L{n}": ([int(t) for t in rng.integers(3, cfg.vocab_size, n)], cont) for n in lengths}

    def engine(replay: bool, n_replay: int = 128, num=quant.REFERENCE, decode_bucket: int = 8) -> TeacherForced:
        # one prefill chunk size, one block-table width and one decode batch: each program compiles once
        ec = EngineConfig(max_num_seqs=8, max_model_len=max_len, max_num_batched_tokens=512,
                          swa_bounded_replay=replay, swa_replay_tokens=n_replay, enable_prefix_caching=False,
                          numerics=num, keep_logits=True, min_prefill_bucket=512, min_decode_bucket=decode_bucket)
        eng = TeacherForced(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg), ec)
        eng.forced = {}
        return eng

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        log.info("%s: %.0f s", name, time.perf_counter() - t)
        return out

    exact = timed("exact", lambda: score(engine(False), jobs, True))
    cols: dict[str, dict[str, tuple]] = {}
    for n in replay_ns:
        rep = timed(f"replay N={n}", lambda n=n: score(engine(True, n), jobs, True))
        cols[f"replay N={n}"] = {k: compare(exact[k], rep[k]) for k in jobs}
    f32 = timed("exact f32", lambda: score(engine(False, num=quant.EXACT_F32), jobs, True))
    cols["floor: bf16 vs f32"] = {k: compare(f32[k], exact[k]) for k in jobs}
    if b1:
        sub = {f"L{n}": jobs[f"L{n}"] for n in b1}
        one = timed("exact batch 1", lambda: score(engine(False, decode_bucket=1), sub, False))
        cols["floor: batch 8 vs 1"] = {k: compare(one[k], exact[k]) for k in sub}

    print(f"\n{args.preset} (window {cfg.window_size}, {cfg.n_layers} layers, split L{cfg.split_layer}), seed "
          f"{args.seed} random weights, REFERENCE numerics; {args.tokens} teacher-forced positions after each prompt\n")
    names = list(cols)
    for title, fmt in (("KL(exact || other): mean / max over positions / at position 0",
                        lambda c: f"{c[0]:.2g} / {c[1]:.2g} / {c[2]:.2g}"),
                       ("max |logit difference| over positions", lambda c: f"{c[3]:.3g}")):
        print(f"{title}\n")
        print_table(["prompt tokens", *names], [[n] + [fmt(cols[c][f"L{n}"]) if f"L{n}" in cols[c] else "-"
                                                      for c in names] for n in lengths], "l" * (len(names) + 1))
        print()
    print(f"wall time {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
