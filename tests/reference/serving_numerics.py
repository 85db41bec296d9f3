"""The engine's teacher-forced decode beside the PyTorch reference's full-sequence logits, and the noise floors
that bound their difference (tests/test_engine_reference_numerics.py; docs/REFERENCE_NOTES.md "Serving numerics").

Both sides score the same text: the engine prefills each prompt and then decodes the given continuation, one
token a step, accepting the given token instead of its sample; the reference (causal, full sequence, no cache)
runs prompt + continuation once, and its row p is the next-token distribution after token p. Row PROMPT - 1 is
the engine's prefill logits, the rest its decode steps.

    PYTHONPATH=. .venv/bin/python -m tests.reference.serving_numerics [--seeds 1,2,3,4]

prints, per seed, every pair among the engine and the reference at bf16 and float32 activations (all with FP8
activations and the FP8 / FP4 caches), and the engine with the FP8 activation rounding left out.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

if __name__ == "__main__":  # the test suite's XLA flags (fast compiles), set before jax loads: the tests' programs
    import tests.conftest  # noqa: F401

import numpy as np

from dsv41 import checkpoint, model, quant
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import ModelConfig, preset
from dsv41.tokenizer import BUILTIN_DIR
from tests.reference.driver import rel, run_reference

# 2 sequences of 16 tokens: 8 prompt tokens, then 8 continuation tokens (the prefill's logits and 7 decode steps).
# 16 positions keep every index top-k (16 of at most 16 ratio-1 groups) and the candidate pool (4 blocks of 8)
# from dropping anything, so no selection can flip between the two sides; what is compared is arithmetic.
BATCH, PROMPT, CONT = 2, 8, 8
# Activations float32, every serving format on: FP8 per-32 activations, FP8 SWA / FP4 compressed KV / MXFP4 indexer
# in the pool. The reference's probabilities are float32 (nemo's eager attention), as are the kernels' jnp references
# on the CPU.
F32_FORMATS = quant.Numerics(act_quant=True, kv_quant=True, bf16_probs=False, dtype="float32")


def config() -> ModelConfig:
    """The tiny preset with every expert active: the expert top-k is a discontinuity that turns bf16 rounding noise
    into another expert set (measured with the preset's top-2: one token in 15 took another expert at layer 1
    between the reference's own eager and SDPA attention, and the logits then differed by 0.35 relative), so with
    top-k = all the comparison sees the numerics, not which side of a near-tie a token fell."""
    cfg = preset("tiny")
    return dataclasses.replace(cfg, n_activated_experts=cfg.n_routed_experts)


def setup(seed: int, directory: str | os.PathLike):
    """-> (cfg, params in the release's stored formats, checkpoint dir, ids int32 [BATCH, PROMPT + CONT]).
    The checkpoint holds the same values densely in float32 (FP8 / FP4 values are exact in bf16, so the
    reference's bf16 run reads the weights the engine serves)."""
    cfg = config()
    params = P.init_params(cfg, seed=seed)
    ck = Path(directory)
    if not (ck / "config.json").is_file():
        checkpoint.save_checkpoint(params, cfg, ck, dense_dtype="float32", tokenizer_dir=BUILTIN_DIR, n_shards=1)
    ids = np.random.default_rng(seed).integers(3, cfg.vocab_size, (BATCH, PROMPT + CONT)).astype(np.int32)
    return cfg, params, str(ck), ids


def engine_logits(cfg: ModelConfig, params, ids: np.ndarray, num: quant.Numerics) -> np.ndarray:
    """The engine (attention backend 'reference': the kernels' jnp references on the FP8 / FP4 pool) on each row's
    prompt, teacher-forced through its continuation, the rows in one batch. -> float32 [BATCH * CONT, V]."""
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine, SamplingParams

    class TeacherForced(Engine):
        """Accepts each request's given continuation token in place of the one it sampled."""

        forced: dict[str, list[int]]

        def _accept(self, r, tok):
            return super()._accept(r, self.forced[r.id][len(r.output)])

    eng = TeacherForced(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg), config=EngineConfig(
        max_num_seqs=BATCH, max_model_len=64, max_num_batched_tokens=128, numerics=num, keep_logits=True,
        attention_backend="reference", min_prefill_bucket=16, min_decode_bucket=BATCH, num_pages=BATCH,
        swa_bounded_replay=False))  # prompts this short are exact with replay too; off, one program less compiles
    eng.forced = {str(i): row[PROMPT:].tolist() for i, row in enumerate(ids)}
    for i, row in enumerate(ids):
        eng.add_request(str(i), row[:PROMPT].tolist(), SamplingParams(max_tokens=CONT, ignore_eos=True))
    while eng.has_work():
        eng.step()
    return np.concatenate([np.stack(eng.finished_logits.pop(str(i))) for i in range(len(ids))]).astype(np.float32)


def reference_logits(ck: str, ids: np.ndarray, dtype: str, act_quant: bool = True, attn: str = "eager") -> np.ndarray:
    """nemo on prompt + continuation (less its last token), FP8 activations and its cache quantize-dequantize on.
    -> float32 [BATCH * CONT, V], rows ordered as `engine_logits`'."""
    out = run_reference(ck, ids[:, :-1], dtype, act_quant=act_quant, attn=attn)["logits"]
    return out[:, PROMPT - 1:].reshape(-1, out.shape[-1])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """[positions, V] logits -> KL(ref || other) mean and max over positions, max |logit difference|, top-1
    agreement, relative L2."""
    lp, lq = _log_softmax(ref), _log_softmax(other)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "max_abs": float(np.abs(ref - other).max()),
            "top1": float((ref.argmax(-1) == other.argmax(-1)).mean()), "rel": rel(other, ref)}


def main():
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1,2,3,4")
    args = ap.parse_args()
    engine_runs = {"engine bf16": quant.REFERENCE, "engine f32": F32_FORMATS,
                   "engine f32, no FP8 act": dataclasses.replace(F32_FORMATS, act_quant=False),
                   "engine bf16, no FP8 act": dataclasses.replace(quant.REFERENCE, act_quant=False)}
    pairs = [("ref bf16", "engine bf16"), ("ref bf16", "ref bf16 sdpa"), ("ref f32", "ref bf16"),
             ("engine f32", "engine bf16"), ("ref f32", "engine f32"), ("ref f32", "engine f32, no FP8 act"),
             ("ref bf16", "engine bf16, no FP8 act")]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in map(int, args.seeds.split(",")):
            cfg, params, ck, ids = setup(seed, Path(tmp) / str(seed))
            runs = {name: engine_logits(cfg, params, ids, num) for name, num in engine_runs.items()}
            runs["ref bf16"] = reference_logits(ck, ids, "bfloat16")
            runs["ref bf16 sdpa"] = reference_logits(ck, ids, "bfloat16", attn="sdpa")
            runs["ref f32"] = reference_logits(ck, ids, "float32")
            print(f"seed {seed}: | a | b | KL mean | KL max | max abs dlogit | top-1 | rel-L2 |")
            for a, b in pairs:
                c = compare(runs[a], runs[b])
                print(f"| {a} | {b} | {c['kl_mean']:.2g} | {c['kl_max']:.2g} | {c['max_abs']:.2g} | "
                      f"{c['top1']:.0%} | {c['rel']:.2g} |")


if __name__ == "__main__":
    main()
