"""DSpark speculative decoding in the engine (tiny preset, one CPU device): greedy tokens identical with and
without it. Random weights make DSpark's drafts almost always wrong, which checks that rejected drafts leave no
trace (their ring slots, KV entries and pending compressor groups); drafts taken from the plain run's own tokens,
with one wrong at chosen steps, check acceptance: several tokens a step, mixed accept lengths in one batch.

Two requests run together: a 150-token prompt (its rings wrap during decode) and a 37-token one (odd: its chunks
re-run the token before the anchor). The DSpark forward itself is tests/test_dspark_reference.py's.

With confidence_threshold each row verifies a prefix of its drafts: the same tokens, fewer drafts verified, and at
threshold 1 a plain decode step (one token, no draft pages)."""

from __future__ import annotations

import numpy as np
import pytest

from serving.engine import programs, spec_sampling
from serving.engine.config import SpeculativeConfig
from serving.engine.speculative import verify_lengths
from serving.engine.errors import EngineError
from serving.engine.sampling import SamplingParams
from tests import tiny_engine

pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)

K = 5
# max |logit| difference. Not tests/test_engine.py's 1e-4: the speculative engine's programs have other shapes (rings
# k slots longer, k + 1 tokens a decode row), so they sum in other orders, and a value a few ulps from an FP8 bin
# edge of the KV rounds to the other bin (the prefill logits alone moved by 5.6e-4 with the longer rings). A wrong
# position, mask or rolled-back slot moves logits by O(0.1).
TOL = 5e-3
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPTS = {"long": list(np.random.default_rng(5).integers(3, 1000, 150)),
           "short": list(np.random.default_rng(6).integers(3, 1000, 37))}


def run(eng, oracle=None, cut=None, check=None):
    """Both prompts at once to the end. oracle: tokens by request; after each step each request's next drafts are
    its next oracle tokens, the third one wrong every third step (cut(step, request id) of them: the drafts it
    verifies, as `verify_lengths` would keep them). check(eng) runs after each step. -> (tokens, logits, steps)."""
    for rid, p in PROMPTS.items():
        eng.add_request(rid, p, GREEDY)
    toks = {rid: [] for rid in PROMPTS}
    steps = 0
    while eng.has_work():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
        steps += 1
        for r in eng.running.values() if oracle else ():
            n = len(r.output)
            d = list(oracle[r.id][n:n + K])
            if len(d) >= 3 and steps % 3 == 0:
                d[2] = (d[2] + 1) % 1000
            r.drafts = d if cut is None else d[:cut(steps, r.id)]
        if check is not None:
            check(eng)
    return toks, {rid: np.stack(eng.finished_logits[rid]) for rid in PROMPTS}, steps


@pytest.fixture(scope="module")
def plain():
    return run(tiny_engine.make())


def speculative(split_decode=None, **kw):
    # max_model_len: the block tables stay tiny_engine's 8 pages wide with room for the k drafts past the end
    return tiny_engine.make(speculative_config=SpeculativeConfig(num_speculative_tokens=K, **kw),
                            max_model_len=tiny_engine.BASE["max_model_len"] - K, split_decode=split_decode)


def test_dspark_drafts_change_no_token(plain):
    """Also: after warm-up the steps compile nothing (the prefill programs that seed the DSpark rings, the
    speculative decode program)."""
    eng = speculative()
    eng.warmup()
    progs = (programs.run_encoder, programs.run_decoder, programs.ONE_DEVICE.run_spec)
    before = [p._cache_size() for p in progs]
    toks, logits, steps = run(eng)
    assert [p._cache_size() for p in progs] == before
    assert toks == plain[0]
    for rid in PROMPTS:
        assert np.abs(logits[rid] - plain[1][rid]).max() < TOL, rid
    st = eng.stats()
    assert st["spec_drafts"] > 20 and st["spec_draft_tokens"] == K * st["spec_drafts"]


@pytest.fixture(scope="module")
def accepted(plain):
    """The speculative engine (one program a step) on the plain run's own tokens as drafts: (run's result, stats)."""
    eng = speculative()
    return run(eng, oracle=plain[0]), eng.stats()


def test_accepted_drafts_are_the_target_tokens(plain, accepted):
    (toks, logits, steps), st = accepted
    assert toks == plain[0]
    for rid in PROMPTS:
        assert np.abs(logits[rid] - plain[1][rid]).max() < TOL, rid
    assert steps < plain[2] / 2 and st["spec_accepted_tokens"] > 2 * st["spec_drafts"]
    # the wrong third draft every third step: position 2 and later are accepted less often than 0 and 1
    per_pos = st["spec_accepted_per_pos"]
    assert sum(per_pos) == st["spec_accepted_tokens"] and per_pos[0] >= per_pos[1] > per_pos[2] >= per_pos[4]


def test_split_step_is_the_one_program(plain, accepted):
    """`split_decode=True`: each speculative step runs `run_decode_first` then `run_spec_rest` (cut at the split
    layer, before DSpark's target layers), both compiled by warm-up; the same tokens and acceptance as the one
    program's, and its logits within 2e-3: on the CPU the speculative programs compile with XLA's fast-compile
    preset and `run_decode_first` does not, which moves a step's logits by ~4e-6, and where that flips an FP8 KV
    code, the later steps' by up to 5.4e-4; a misplaced row, ring or carry at the cut moves them by O(0.1)."""
    eng = speculative(split_decode=True)
    assert eng.decode_kinds == ("decode_first", "spec_rest")
    eng.warmup()
    progs = (programs.ONE_DEVICE.run_decode_first, programs.ONE_DEVICE.run_spec_rest)
    before = [p._cache_size() for p in progs]
    toks, logits, steps = run(eng, oracle=plain[0])
    assert [p._cache_size() for p in progs] == before
    (toks1, logits1, steps1), st1 = accepted
    assert toks == toks1 and steps == steps1
    for rid in PROMPTS:
        assert np.abs(logits[rid] - logits1[rid]).max() < 2e-3, rid
    assert eng.stats()["spec_accepted_per_pos"] == st1["spec_accepted_per_pos"]
    assert speculative().decode_kinds == ("decode",)  # the CPU's default, and a GPU's until measured there


class _BranchCalls:
    """An engine's programs, noting each speculative call's sampling `branch` (`spec_sampling.verify`) in the split
    step's second half."""

    def __init__(self, progs):
        self.progs, self.branches = progs, []

    def __getattr__(self, name):
        return getattr(self.progs, name)

    def run_spec_rest(self, *args, **kw):
        self.branches.append(kw["branch"])
        return self.progs.run_spec_rest(*args, **kw)


def test_greedy_program_serves_the_all_greedy_steps(accepted):
    """`greedy_program`: a step whose rows are all greedy runs the speculative program without its sampling (warm-up
    compiles it for each decode bucket), any other the program whose sampling filters every row (no branch on the
    device). The accepted run's tokens, steps and acceptance, its logits within 2e-3 (another program, so the FP8 KV
    codes a few ulps from a bin edge may round the other way, as between the split and the one program), nothing
    compiled after warm-up; a sampled request's seeded tokens as the program with the device's branch gives them.
    The step split, as a GPU runs it (and its halves compile in half the time of the one program here)."""
    eng = speculative(greedy_program=True, split_decode=True)
    assert eng.greedy_kind == "spec_rest_greedy"
    kinds = ("decode_first", "spec_rest", "spec_rest_greedy")
    assert [s[0] for s in eng.program_shapes() if s[0] in kinds] == list(kinds)
    eng.warmup()
    eng.programs = calls = _BranchCalls(eng.programs)
    before = programs.ONE_DEVICE.run_spec_rest._cache_size()
    toks, logits, steps = run(eng, oracle=accepted[0][0])
    assert programs.ONE_DEVICE.run_spec_rest._cache_size() == before
    (toks1, logits1, steps1), st1 = accepted
    assert toks == toks1 and steps == steps1
    assert eng.stats()["spec_accepted_per_pos"] == st1["spec_accepted_per_pos"]
    for rid in PROMPTS:
        assert np.abs(logits[rid] - logits1[rid]).max() < 2e-3, rid
    assert calls.branches and set(calls.branches) == {spec_sampling.GREEDY}
    sp = SamplingParams(max_tokens=6, temperature=5.0, seed=3, ignore_eos=True)
    sampled = [tiny_engine.drain(e, {"s": (PROMPTS["short"], sp)})[0]["s"] for e in (eng, speculative())]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 6 and calls.branches[-1] == spec_sampling.FILTERED


def test_verify_lengths_follow_the_cumulative_confidence():
    conf = np.array([[3.0, 3.0, -3.0, 3.0, 3.0], [-1.0, 5.0, 5.0, 5.0, 5.0], [20.0] * 5, [0.0] * 5])
    cum = np.cumprod(1 / (1 + np.exp(-conf)), axis=1)  # the chance that drafts 1 .. i are all accepted
    for t in (0.05, 0.3, 0.5, 0.9, 0.999):
        want = np.array([next((i for i in range(5) if c[i] < t), 5) for c in cum])
        np.testing.assert_array_equal(verify_lengths(conf, t), want)
    assert verify_lengths(conf, 1.0).tolist() == [0] * 4 and verify_lengths(conf, None).tolist() == [5] * 4


def test_confidence_threshold_keeps_the_tokens(plain):
    """The drafter's confidence cuts each row's verification (at 0.5 the tiny model's random head keeps 0 to 2 of
    5): the same tokens; only the verified drafts count."""
    eng = speculative(confidence_threshold=0.5)
    toks, logits, _ = run(eng)
    assert toks == plain[0]
    for rid in PROMPTS:
        assert np.abs(logits[rid] - plain[1][rid]).max() < TOL, rid
    st = eng.stats()
    per_len = st["spec_verified_per_len"]
    assert sum(per_len) == st["spec_drafts"] and sum(n > 0 for n in per_len) >= 2 and per_len[K] == 0
    assert st["spec_draft_tokens"] == sum(n * c for n, c in enumerate(per_len))


def test_cut_drafts_accept_up_to_the_cut(plain):
    """Oracle drafts verified to a cut that differs between the two rows and steps (0 .. 5): the tokens of the
    plain run, the drafts up to each cut accepted, none past it."""
    eng = speculative(confidence_threshold=0.5)
    toks, logits, steps = run(eng, oracle=plain[0], cut=lambda step, rid: (step + len(rid)) % (K + 1))
    assert toks == plain[0]
    for rid in PROMPTS:
        assert np.abs(logits[rid] - plain[1][rid]).max() < TOL, rid
    st = eng.stats()
    per_len, per_pos = st["spec_verified_per_len"], st["spec_accepted_per_pos"]
    assert all(per_len) and steps < plain[2] * 3 / 4
    assert all(per_pos[j] <= sum(per_len[j + 1:]) for j in range(K)) and per_pos[0] > 0


def test_threshold_one_is_plain_decode(plain):
    """Threshold 1 verifies no draft: a plain step each (the plain run's greedy tokens, steps and seeded samples),
    holding pages for its tokens only (the speculative engine without a cut holds k more)."""
    def pages_fit(eng):
        for r in eng.running.values():
            assert len(r.pages) <= -(-r.num_tokens // eng.layout.page_tokens), r.id

    eng = speculative(confidence_threshold=1.0)
    toks, logits, steps = run(eng, check=pages_fit)
    assert toks == plain[0] and steps == plain[2]
    st = eng.stats()
    assert st["spec_draft_tokens"] == 0 and st["spec_verified_per_len"] == [st["spec_drafts"]] + [0] * K
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    sampled = []
    for e in (tiny_engine.make(), speculative(confidence_threshold=1.0)):
        e.add_request("s", PROMPTS["short"], sp)
        sampled.append([t for _ in iter(e.has_work, False) for o in e.step() for t in o.new_token_ids])
    assert sampled[0] == sampled[1] and len(sampled[0]) == 8


def test_forced_acceptance_takes_every_draft():
    eng = speculative(forced_acceptance=True)
    toks, _, _ = run(eng)
    st = eng.stats()
    # each request: the prefill's token, then k accepted drafts and the bonus a step up to max_tokens
    n = GREEDY.max_tokens - 1
    steps = -(-n // (K + 1))
    assert st["spec_draft_tokens"] == 2 * steps * K and st["spec_accepted_tokens"] == 2 * (n - steps)
    assert st["spec_accepted_per_pos"] == [2 * steps] * (K - 1) + [2 * (steps - 1)]  # the last step takes 4
    assert all(len(t) == GREEDY.max_tokens for t in toks.values())


def test_bad_speculative_configs_name_the_fix():
    with pytest.raises(EngineError, match="num_speculative_tokens"):
        SpeculativeConfig.from_json('{"method": "dspark", "num_speculative_tokens": 0}')
    with pytest.raises(EngineError, match="unknown key"):
        SpeculativeConfig.from_json('{"method": "dspark", "draft_model": "x"}')
    with pytest.raises(EngineError, match="confidence_threshold"):
        SpeculativeConfig.from_json('{"method": "dspark", "confidence_threshold": 0}')
    with pytest.raises(EngineError, match="only 'dspark'"):
        SpeculativeConfig.from_json('{"method": "eagle"}')
    with pytest.raises(EngineError, match="block of 5"):
        tiny_engine.make(speculative_config=SpeculativeConfig(num_speculative_tokens=6))
    with pytest.raises(EngineError, match="greedy_program must be true, false or null"):
        SpeculativeConfig.from_json('{"greedy_program": "yes"}')
    assert SpeculativeConfig.from_json('{"method": "dspark", "num_speculative_tokens": 3}').num_speculative_tokens == 3


def test_greedy_program_is_a_gpus_default():
    """The all-greedy program spares a GPU's step its host round trips; a CPU's conds are local (no program added)."""
    assert SpeculativeConfig().uses_greedy_program("gpu") and not SpeculativeConfig().uses_greedy_program("cpu")
    assert SpeculativeConfig(greedy_program=True).uses_greedy_program("cpu")
    assert not SpeculativeConfig.from_json('{"greedy_program": false}').uses_greedy_program("gpu")
    assert speculative().greedy_kind is None  # this CPU's default


def test_seeded_sampling_speculates_and_repeats():
    """Sampled requests speculate by rejection sampling (`spec_sampling.verify`, whose distribution
    tests/test_spec_sampling.py checks): at temperature 5 the tiny model's and the drafter's distributions are
    both nearly flat, so drafts are accepted; a seed gives the same tokens again."""
    sp = SamplingParams(max_tokens=16, temperature=5.0, seed=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        eng = speculative()
        eng.add_request("s", PROMPTS["short"], sp)
        toks = []
        while eng.has_work():
            for o in eng.step():
                toks += o.new_token_ids
        runs.append((toks, eng.stats()))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 16
    assert runs[0][1]["spec_accepted_tokens"] > runs[0][1]["spec_drafts"]


def test_preemption_under_speculation():
    """Two requests the 5-page pool cannot hold with their drafts' pages: one is preempted and recomputed (its
    drafter states are not carried over: its first step after that takes no sampled draft), both finish and
    every page comes back."""
    eng = speculative()
    for rid, n in (("a", 180), ("b", 150)):
        eng.add_request(rid, list(np.random.default_rng(n).integers(3, 1000, n)), GREEDY)
    outs = {"a": [], "b": []}
    while eng.has_work():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    st = eng.stats()
    assert [len(t) for t in outs.values()] == [GREEDY.max_tokens] * 2
    assert st["preemptions"] >= 1 and st["kv_pages_used"] == 0
