"""The context length as a run-time value: the XLA indexer scores only the blocks of pages some query sees
(`programs._context_scores`, a loop with a run-time trip count) and merges their top-k block by block
(`_context_topk`), with the scores and entries of scoring every page at once (`_context_index_keys` +
`indexer.scores` + `indexer.select_topk`, the one-pass form)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import indexer, quant
from serving.engine import programs


def _pool(seed, B, C, P, E=16, IH=8, ID=64, S=3):
    rng = np.random.default_rng(seed)
    # values on a coarse grid (the keys are MXFP4 values): every sum is exact in float32, whatever the order XLA
    # sums in for each block's shape
    q = jnp.asarray(rng.integers(-4, 5, (B, S, IH, ID)) / 4.0, jnp.float32)
    w = jnp.asarray(rng.integers(-4, 5, (B, S, IH)) / 4.0, jnp.float32)
    pages = types.SimpleNamespace(ik_packed=jnp.asarray(rng.integers(0, 256, (P, E, ID // 2)), jnp.uint8),
                                  ik_scale=jnp.asarray(rng.integers(125, 130, (P, E, ID // 32)), jnp.uint8))
    bt = np.full((B, C), P, np.int32)  # num_pages where unused, as the scheduler fills it
    return q, w, pages, bt, rng


@pytest.mark.parametrize("block_entries", [32, 2048])  # several blocks of 2 pages, or one block of the table
def test_context_scores_equal_one_pass(monkeypatch, block_entries):
    monkeypatch.setattr(programs, "SCORE_BLOCK_ENTRIES", block_entries)
    B, C, P, E, r = 3, 7, 40, 16, 4
    q, w, pages, bt, rng = _pool(1, B, C, P, E)
    used = [5, 1, 0]  # pages each row holds (row 2: a padding row)
    for i, n in enumerate(used):
        bt[i, :n] = rng.permutation(P)[:n]
    pos = jnp.asarray([[300, 310, 319], [10, 40, 63], [0, 1, 2]], jnp.int32)  # within each row's pages
    cfg = types.SimpleNamespace(index_head_dim=q.shape[-1])
    num = quant.Numerics(act_quant=False, bf16_probs=False, dtype="float32")

    @jax.jit
    def both(q, w, bt, pos):
        blocked = programs._context_scores(q, w, pages, bt, pos, r, cfg, num)
        keys = programs._context_index_keys(pages, bt, cfg)
        return blocked, indexer.scores(q, w, keys, pos, r, num)

    blocked, one_pass = both(q, w, jnp.asarray(bt), pos)
    assert blocked.shape == (B, 3, C * E)
    np.testing.assert_array_equal(np.asarray(blocked), np.asarray(one_pass))
    assert np.isfinite(np.asarray(blocked)[0, 2, :80]).all() and np.isneginf(np.asarray(blocked)[0, 2, 80:]).all()


def test_blocks_past_the_visible_entries_are_not_scored(monkeypatch):
    """Pages past every query's visible entries are never read: NaN keys there change nothing."""
    monkeypatch.setattr(programs, "SCORE_BLOCK_ENTRIES", 32)
    B, C, P, E, r = 2, 8, 20, 16, 4
    q, w, pages, bt, rng = _pool(2, B, C, P, E)
    bt[:] = rng.permutation(P)[:B * C].reshape(B, C)  # every column names a real page
    pos = jnp.asarray([[60, 61, 62], [0, 5, 9]], jnp.int32)  # at most 15 entries: the first block (2 pages)
    cfg = types.SimpleNamespace(index_head_dim=q.shape[-1])
    num = quant.Numerics(act_quant=False, bf16_probs=False, dtype="float32")
    # scale 255 is UE8M0's NaN: a page whose keys all decode to NaN
    poisoned = pages.ik_scale.at[bt[:, 2:].reshape(-1)].set(255)
    bad = types.SimpleNamespace(ik_packed=pages.ik_packed, ik_scale=poisoned)

    def f(pg, pos):
        return np.asarray(jax.jit(lambda q, w, bt, pos: programs._context_scores(q, w, pg, bt, pos, r, cfg, num))(
            q, w, jnp.asarray(bt), pos))

    out = f(bad, pos)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out, f(pages, pos))
    # the same NaN pages inside the visible blocks do reach the scores (the test can fail)
    assert np.isnan(f(bad, jnp.asarray([[200, 201, 202], [0, 5, 9]], jnp.int32))).any()


@pytest.mark.parametrize("with_candidates", [False, True])
def test_context_topk_merges_blocks_as_one_selection(monkeypatch, with_candidates):
    """The XLA indexer's top-k, merged block by block (`_context_topk`), picks `indexer.select_topk`'s entries of
    the one-pass scores: ties (coarse values make many) to the lower id, rows that see fewer than k entries or
    none, and candidate masks with fewer than k visible candidates (the -inf entries then picked by id)."""
    monkeypatch.setattr(programs, "SCORE_BLOCK_ENTRIES", 32)  # 2 pages a block, 4 blocks
    B, C, P, E, r = 3, 8, 40, 16, 2
    q, w, pages, bt, rng = _pool(4, B, C, P, E, S=4)
    for i, n in enumerate((8, 3, 1)):
        bt[i, :n] = rng.permutation(P)[:n]
    pos = jnp.asarray([[255, 200, 130, 70], [95, 60, 20, 7], [1, 0, 0, 0]], jnp.int32)
    cfg = types.SimpleNamespace(index_head_dim=q.shape[-1], index_topk=24)
    num = quant.Numerics(act_quant=False, bf16_probs=False, dtype="float32")
    mask = jnp.asarray(rng.random((B, 4, C * E)) < 0.1) if with_candidates else None

    @jax.jit
    def both(q, w, bt, pos, mask):
        got = programs._context_topk(q, w, pages, bt, pos, r, cfg, num, mask)
        s = indexer.scores(q, w, programs._context_index_keys(pages, bt, cfg), pos, r, num)
        return got, indexer.select_topk(s if mask is None else jnp.where(mask, s, -jnp.inf), pos, r, cfg)

    got, want = both(q, w, jnp.asarray(bt), pos, mask)
    assert got.shape == (B, 4, 24)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(want)[2] == -1).sum() > 0 and (np.asarray(want)[0, 0] >= 32).any()  # short rows, far blocks
