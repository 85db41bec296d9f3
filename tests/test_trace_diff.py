"""dsv41.trace_diff on hand-made traces: the first flip per row, its tie measure, the untouched prefixes."""

import numpy as np

from dsv41 import trace_diff


def _traces():
    rows, seq = 2, 6
    topk = np.tile(np.array([0, 1, -1], np.int32), (rows, seq, 1))
    scores = np.zeros((rows, seq, 4), np.float32)
    scores[1, 4] = [5.0, 1.0000001, 1.0, -2.0]  # ids 1 and 2 tie to an ulp at row 1, position 4
    experts = np.tile(np.array([3, 5], np.int32), (rows, seq, 1))
    cand = np.ones((rows, seq, 8), bool)
    a = {"layer0.topk": topk, "layer0.index_scores": scores, "layer2.moe.experts": experts,
         "layer1.candidates": cand}
    b = {k: v.copy() for k, v in a.items()}
    return a, b


def test_no_flips():
    a, b = _traces()
    assert trace_diff.first_flips(a, b, 3) == {}
    np.testing.assert_array_equal(trace_diff.compared_prefix({}, 2, 6), [6, 6])


def test_first_flip_per_row_and_its_tie():
    a, b = _traces()
    b["layer0.topk"][1, 4:] = [0, 2, -1]  # row 1: a tie flip at position 4, carried on to 5
    b["layer2.moe.experts"][1, 5] = [3, 6]  # a later position, later layer: not the first
    b["layer1.candidates"][0, 3, 7] = False  # row 0: a candidate mask differs at position 3
    flips = trace_diff.first_flips(a, b, 3)
    assert set(flips) == {0, 1}
    f = flips[1]
    assert (f.layer, f.name, f.pos, f.a_only.tolist(), f.b_only.tolist()) == (0, "topk", 4, [1], [2])
    assert 0 < f.spread < 1e-6
    g = flips[0]
    assert (g.layer, g.name, g.pos, g.a_only.tolist(), g.b_only.tolist(), g.spread) == (1, "candidates", 3, [7], [],
                                                                                         None)
    np.testing.assert_array_equal(trace_diff.compared_prefix(flips, 2, 6), [3, 4])


def test_an_earlier_position_in_a_later_layer_wins():
    a, b = _traces()
    b["layer0.topk"][0, 5] = [0, 3, -1]
    b["layer2.moe.experts"][0, 2] = [3, 4]
    scores = lambda layer, name, row, pos: np.arange(8, dtype=np.float32) if name == "moe.experts" else None
    f = trace_diff.first_flips(a, b, 3, scores)[0]
    assert (f.layer, f.name, f.pos) == (2, "moe.experts", 2)
    assert f.spread == (5 - 4) / 5  # scores 5 (kept by a) and 4 (kept by b): not a tie


def test_the_same_set_in_another_order_is_not_a_flip():
    """A top-k whose scores moved by ulps may list the same picks in another order (the H200's bench-preset run
    did, and the spread of no entries raised): skipped, and the row's next real difference is its flip."""
    a, b = _traces()
    b["layer0.topk"][1, 2] = [1, 0, -1]  # reordered only
    b["layer2.moe.experts"][1, 3] = [5, 3]  # reordered only
    b["layer2.moe.experts"][1, 4] = [3, 6]
    f = trace_diff.first_flips(a, b, 3)[1]
    assert (f.layer, f.name, f.pos, f.a_only.tolist(), f.b_only.tolist()) == (2, "moe.experts", 4, [5], [6])
    assert set(trace_diff.first_flips(a, b, 2)) == set()
