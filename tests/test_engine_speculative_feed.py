"""DSpark speculative steps fed on the device (`EngineConfig.device_feed` with `--speculative-config`): each step is
dispatched before the host reads the one in flight, and a row continuing it builds its chunk there
(`programs.SpecFeed`: the bonus token, the drafts the drafter drew, the token before an odd anchor, the positions
and the Engram rows). The tokens, finish reasons, logits and acceptance counts are the synchronous speculative
engine's.

Forced acceptance with a confidence threshold makes each row accept exactly the drafts its drafter's confidence
kept (0 to 2 of 5 with the tiny model's random head), so the accept lengths, and with them the anchors' parities
and the Engram histories' shifts, differ between rows and steps; a greedy row, a seeded sampled row and a row that
ends on a stop id run beside it."""

import numpy as np
import pytest
import tiny_engine

from serving.engine import programs
from serving.engine.config import SpeculativeConfig
from serving.engine.sampling import SamplingParams

pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)

K = 5
prompt = tiny_engine.prompt
# the 150-token prompt's DSpark rings wrap while it decodes; 37 tokens: an odd anchor after the prefill
REQUESTS = {
    "a": (prompt(150, 5), SamplingParams(max_tokens=20, ignore_eos=True)),
    "b": (prompt(37, 6), SamplingParams(max_tokens=14, temperature=1.0, seed=7, ignore_eos=True)),
    "c": (prompt(60, 3), SamplingParams(max_tokens=16, stop_token_ids=tuple(range(0, 129280, 7)))),
}


def speculative(forced: bool = True, **kw):
    # max_model_len: the block tables stay tiny_engine's 8 pages wide with room for the k drafts past the end
    spec = (SpeculativeConfig(num_speculative_tokens=K, forced_acceptance=True, confidence_threshold=0.5) if forced
            else SpeculativeConfig(num_speculative_tokens=K))
    return tiny_engine.make(speculative_config=spec, max_model_len=tiny_engine.BASE["max_model_len"] - K, **kw)


def serve(eng):
    toks, reasons = tiny_engine.drain(eng, REQUESTS)
    st = eng.stats()
    counts = {k: st[k] for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_per_pos",
                                 "spec_verified_per_len")}
    return toks, reasons, eng.finished_logits, counts


@pytest.fixture(scope="module")
def synchronous():
    return serve(speculative())


@pytest.mark.parametrize("split", [False, True])
def test_fed_speculative_steps_equal_synchronous(synchronous, split):
    """Fed, as one program and cut at the split layer (a GPU's speculative step: `run_decode_first` resolves the
    feed for its layers, `run_spec_rest` again for its own and the verify), against the synchronous one program.
    After warm-up nothing compiles."""
    want_t, want_r, want_l, want_c = synchronous
    eng = speculative(device_feed=True, split_decode=split)
    assert eng.async_scheduling and len(eng.decode_kinds) == 1 + split
    eng.warmup()
    jits = (programs.ONE_DEVICE.run_spec, programs.ONE_DEVICE.run_decode_first, programs.ONE_DEVICE.run_spec_rest,
            eng._pad)
    before = [p._cache_size() for p in jits]
    eng.programs = counted = tiny_engine.FedRows(eng.programs, ("run_spec", "run_decode_first"), programs.SpecFeed)
    toks, reasons, logits, counts = serve(eng)
    assert [p._cache_size() for p in jits] == before
    assert toks == want_t and reasons == want_r and counts == want_c
    for rid in want_l:  # the split programs compile without the CPU's fast preset (`programs._spec_rest`)
        np.testing.assert_allclose(np.stack(logits[rid]), np.stack(want_l[rid]), rtol=0, atol=1e-4 if split else 2e-5)
    # mixed accept lengths (the test's premise), and every step after a row's first continued the one in flight
    assert sum(n > 0 for n in want_c["spec_verified_per_len"]) >= 2
    assert counted.fed >= want_c["spec_drafts"] - len(REQUESTS) and counted.host <= len(REQUESTS)


def test_preempted_with_a_speculative_step_in_flight():
    """Two requests the 5-page pool cannot hold with their drafts' pages (a fed row holds pages for the longest
    advance of the step in flight too): a row's pages preempt the other while its step is in flight. Its tokens
    are read as a preempted request's and it recomputes from prompt + output: the synchronous engine's greedy
    tokens (not forced: forced tokens are the drafts, which depend on when the recompute happens)."""
    def run(**kw):
        eng = speculative(forced=False, **kw)
        greedy = SamplingParams(max_tokens=24, ignore_eos=True)
        reqs = {rid: (prompt(n, n), greedy) for rid, n in (("a", 180), ("b", 150))}
        return tiny_engine.drain(eng, reqs)[0], eng.stats()

    want, _ = run()
    got, st = run(device_feed=True)
    assert got == want and st["preemptions"] >= 1 and st["kv_pages_used"] == 0
