"""The tiny preset's engine as the engine tests build it, shared by every test file that runs one on the CPU.

The engine's programs are module-level jits: two engines with the same config, numerics, kernels and shapes
share their compiled programs inside one process. A CPU compile of one is ~10 s, so the tests that build an
engine take it from here and sit in one xdist group (`GROUP`, one worker) instead of each compiling its own."""

from __future__ import annotations

import functools

import numpy as np

from dsv41 import model, quant
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import preset
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine

GROUP = "tiny_engine"
# float32 activations with the serving formats' KV numerics: engine against model differ by summation order only
NUM = quant.Numerics(act_quant=False, bf16_probs=False, dtype="float32")
# one prefill width, one block-table width, one decode width (a lone sequence pads to 2 rows) and one pool size.
# 5 pages (320 tokens) hold every request of the engine tests; two of ~170 tokens force a preemption
BASE = dict(max_num_seqs=2, max_model_len=512, max_num_batched_tokens=128, numerics=NUM, keep_logits=True,
            min_prefill_bucket=128, min_decode_bucket=2, num_pages=5)


@functools.lru_cache(maxsize=1)
def tiny():
    """(config, float32 parameters with the Engram tables), seed 0."""
    cfg = preset("tiny")
    return cfg, P.dequantize_params(P.init_params(cfg, seed=0), "float32")


def prompt(n: int, seed: int) -> list:
    """n random token ids (3-999, inside the tiny vocabulary), seeded."""
    return list(np.random.default_rng(seed).integers(3, 1000, n))


def make(**kw) -> Engine:
    cfg, params = tiny()
    return Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg), config=EngineConfig(**{**BASE, **kw}))


def drain(eng: Engine, requests: dict) -> tuple[dict, dict]:
    """requests (id -> (prompt ids, SamplingParams)) added at once, the engine stepped until idle. -> (tokens by
    id, finish reasons by id)."""
    for rid, (ids, s) in requests.items():
        eng.add_request(rid, ids, s)
    toks, reasons = {rid: [] for rid in requests}, {}
    while eng.has_work():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return toks, reasons


class FedRows:
    """An engine's programs (`eng.programs = FedRows(eng.programs, names)`), counting over the calls of the programs
    named the live decode rows whose input the program takes from the step before on the device (their feed's
    index >= 0: `programs.Feed`, `programs.SpecFeed`) and those the host gave. feed: the type every fed batch's feed
    must have (None: any)."""

    def __init__(self, progs, names: tuple[str, ...], feed: type | None = None):
        self.progs, self.names, self.feed, self.fed, self.host = progs, names, feed, 0, 0

    def __getattr__(self, name):
        fn = getattr(self.progs, name)
        if name not in self.names:
            return fn

        def counted(params, pool, b, *args, **kw):
            if b.feed is not None:
                assert self.feed is None or isinstance(b.feed, self.feed), type(b.feed)
                live, idx = np.asarray(b.n_valid) > 0, np.asarray(b.feed.index)
                self.fed += int((live & (idx >= 0)).sum())
                self.host += int((live & (idx < 0)).sum())
            return fn(params, pool, b, *args, **kw)

        return counted
