"""Decode steps fed on the device (`EngineConfig.device_feed`) against the synchronous engine: the same tokens,
finish reasons and logits; every decode row's token taken on the device from the step before; a preemption while a
token is in flight."""

import numpy as np
import pytest
import tiny_engine

from serving.engine import programs
from serving.engine.engine import SamplingParams

pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)


prompt = tiny_engine.prompt


# greedy and seeded rows, a two-chunk prompt, stop ids that end a request early (its row runs a step more), one
# that ends at its first token; two slots, so later requests wait for earlier ones to finish
REQUESTS = {
    "a": (prompt(30, 1), SamplingParams(max_tokens=9, ignore_eos=True)),
    "b": (prompt(140, 2), SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)),
    "c": (prompt(60, 3), SamplingParams(max_tokens=8, stop_token_ids=tuple(range(0, 129280, 2)))),
    "d": (prompt(20, 5), SamplingParams(max_tokens=1)),
    "e": (prompt(40, 6), SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)),
}


class Counted:
    """The engine's programs, counting the decode rows whose token came from the device."""

    def __init__(self, progs):
        self.progs, self.fed, self.host = progs, 0, 0

    def __getattr__(self, name):
        return getattr(self.progs, name)

    def _count(self, b):
        if b.feed is not None:
            live = np.asarray(b.n_valid) > 0
            idx = np.asarray(b.feed.index)
            self.fed += int((live & (idx >= 0)).sum())
            self.host += int((live & (idx < 0)).sum())

    def run_full(self, params, pool, b, **kw):
        self._count(b)
        return self.progs.run_full(params, pool, b, **kw)

    def run_decode_first(self, params, pool, b, **kw):
        self._count(b)
        return self.progs.run_decode_first(params, pool, b, **kw)


def serve(eng):
    for rid, (ids, s) in REQUESTS.items():
        eng.add_request(rid, ids, s)
    toks = {rid: [] for rid in REQUESTS}
    reasons = {}
    while eng.has_work():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return toks, reasons, eng.finished_logits


@pytest.fixture(scope="module")
def synchronous():
    return serve(tiny_engine.make())


@pytest.mark.parametrize("split", [False, True])
def test_fed_steps_equal_synchronous(synchronous, split):
    """Every decode row takes its token from the previous step's sampled ids (its prefill call's first token, or its
    decode step's) on the device, with its Engram rows hashed and gathered there (the tiny preset's Engram layers 1
    and 3: before and after the split layer, so the split step resolves the feed in both programs), and each request
    gets the synchronous engine's tokens, finish reason and logits (within float32 summation noise). After warm-up
    nothing compiles: the fed programs and the padding of their ids ran there with a step's signatures."""
    want_t, want_r, want_l = synchronous
    eng = tiny_engine.make(device_feed=True, split_decode=split)
    assert eng.async_scheduling and programs.DEVICE_ENGRAM in eng.params
    eng.warmup()
    jits = (programs.run_full, programs.run_encoder, programs.run_decoder, programs.ONE_DEVICE.run_decode_first,
            programs.ONE_DEVICE.run_decode_rest, eng._pad, eng._pad_first)
    before = [p._cache_size() for p in jits]
    eng.programs = counted = Counted(eng.programs)
    toks, reasons, logits = serve(eng)
    assert [p._cache_size() for p in jits] == before
    assert toks == want_t and reasons == want_r
    for rid in want_l:
        np.testing.assert_allclose(np.stack(logits[rid]), np.stack(want_l[rid]), rtol=0, atol=2e-5)
    # every decode row took its token on the device: the first from its prompt's prefill call, then its own
    # decode step's (a row that stopped on a stop id ran one step more)
    assert counted.host == 0 and counted.fed >= sum(len(t) - 1 for t in want_t.values())


def test_preempted_with_a_token_in_flight():
    """The pool (5 pages of 64 tokens) cannot hold both requests: a decode row's pages preempt the other request
    while its newest token is still in flight on the device. That token is read as a preempted request's, and it
    recomputes from prompt + output as the synchronous engine's preempted request does: the same tokens."""
    def run(**kw):
        eng = tiny_engine.make(**kw)
        eng.add_request("a", prompt(120, 8), SamplingParams(max_tokens=12, ignore_eos=True))
        eng.add_request("b", prompt(180, 9), SamplingParams(max_tokens=8, ignore_eos=True))
        toks = {"a": [], "b": []}
        while eng.has_work():
            for o in eng.step():
                toks[o.request_id] += o.new_token_ids
        return toks, eng.counters["preemptions"]

    want, _ = run()
    got, preemptions = run(device_feed=True)
    assert preemptions >= 1 and got == want
