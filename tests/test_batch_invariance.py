"""EngineConfig(batch_invariant=True): a request's tokens and logits are the same bits alone, inside a batch of 8
mixed-length requests, and after a prefix-cache hit (equal to the cold run with the same replay boundary,
`add_request(replay_at=H)`). Without the flag the decode step's batch and block-table buckets follow the company,
and the logits move by summation order (docs/ARCHITECTURE.md "Batch invariance")."""

import numpy as np
import pytest
import tiny_engine

from serving.engine.sampling import SamplingParams

pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.9, top_p=0.95, top_k=40, seed=11)


def make(batch_invariant: bool, **kw):
    # 8 decode rows, room for 8 sequences; the block table is max_model_len / page_tokens = 8 pages wide when pinned
    return tiny_engine.make(batch_invariant=batch_invariant, max_num_seqs=8, num_pages=64, **kw)


def prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, n)]


def run(eng, reqs):
    """reqs [(id, prompt, sampling, add_request kw)], all queued before the first step
    -> {id: (tokens, logits [tokens, V], cached prompt tokens)}."""
    for rid, p, s, kw in reqs:
        eng.add_request(rid, p, s, **kw)
    toks, cached = {rid: [] for rid, *_ in reqs}, {}
    while eng.has_work():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    return {rid: (toks[rid], np.stack(eng.finished_logits.pop(rid)), cached[rid]) for rid in toks}


def company(tag):
    """Seven requests of mixed lengths (short, past the window, several pages), greedy and sampled."""
    return [(f"{tag}{i}", prompt(n, 10 + i), GREEDY if i % 2 else SAMPLED, {})
            for i, n in enumerate((20, 60, 100, 190, 250, 130, 7))]


def assert_same_bits(a, b):
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])


def test_alone_batched_and_prefix_hit_are_bitwise_identical():
    x = prompt(150, 0)
    eng = make(True, enable_prefix_caching=False)
    # one shape per program: (program, rows, tokens, block-table pages)
    assert sorted(eng.program_shapes()) == [("decode", 8, 1, 8), ("decoder", 1, 1, 8), ("encoder", 1, 128, 8)]
    for s in (GREEDY, SAMPLED):
        alone = run(eng, [("x", x, s, {})])["x"]
        others = company("o")
        batched = run(eng, others[:3] + [("x", x, s, {})] + others[3:])["x"]  # x decodes in row 3 of 8
        assert_same_bits(alone, batched)

    # a second turn: the first turn's prompt and answer, then more; its first two pages come from the cache
    cache = make(True)
    turn1 = prompt(130, 1)
    turn2 = turn1 + run(cache, [("t1", turn1, GREEDY, {})])["t1"][0] + prompt(60, 2)
    hit = run(cache, company("h")[:4] + [("t2g", turn2, GREEDY, {}), ("t2s", turn2, SAMPLED, {})]
              + company("h")[4:])
    H = hit["t2g"][2]
    assert H == 128 and hit["t2s"][2] == H
    for rid, s in (("t2g", GREEDY), ("t2s", SAMPLED)):
        cold = run(eng, [("c", turn2, s, {"replay_at": H})])["c"]
        assert_same_bits(hit[rid], cold)
