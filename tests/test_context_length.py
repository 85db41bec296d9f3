"""The context length as a run-time value: the XLA indexer scores only the blocks of pages some query sees
(`programs._score_blocks`, a loop with a run-time trip count) and merges their top-k block by block
(`programs._context_select`, `indexer.running_topk`; the candidate source's blocks from the block maxima), with
the scores and entries of scoring every page at once (`_context_index_keys` + `indexer.scores` +
`indexer.select_topk` / `indexer.candidate_mask`, the one-pass form)."""

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


def _cfg(q, **kw):
    return types.SimpleNamespace(**{"index_head_dim": q.shape[-1], "index_topk": 24, "candidate_block_size": 8,
                                    "candidate_topk_blocks": 4, **kw})


NUM = quant.Numerics(act_quant=False, bf16_probs=False, dtype="float32")


@pytest.mark.parametrize("block_entries", [32, 2048])  # several blocks of 2 pages, or one block of the table
def test_block_scores_equal_one_pass(monkeypatch, block_entries):
    monkeypatch.setattr(programs, "SCORE_BLOCK_ENTRIES", block_entries)
    B, C, P, E, r = 3, 7, 40, 16, 4
    q, w, pages, bt, rng = _pool(1, B, C, P, E)
    used = [5, 1, 0]  # pages each row holds (row 2: a padding row)
    for i, n in enumerate(used):
        bt[i, :n] = rng.permutation(P)[:n]
    pos = jnp.asarray([[300, 310, 319], [10, 40, 63], [0, 1, 2]], jnp.int32)  # within each row's pages
    cfg = _cfg(q)

    @jax.jit
    def both(q, w, bt, pos):
        block, W, nblk, live = programs._score_blocks(q, w, pages, bt, pos, r, cfg, NUM, 24, 1)
        blocked = jnp.concatenate([block(i) for i in range(nblk)], -1)[..., :C * E]
        keys = programs._context_index_keys(pages, bt, cfg)
        return blocked, indexer.scores(q, w, keys, pos, r, NUM), live

    blocked, one_pass, live = both(q, w, jnp.asarray(bt), pos)
    np.testing.assert_array_equal(np.asarray(blocked), np.asarray(one_pass))
    assert np.isfinite(np.asarray(blocked)[0, 2, :80]).all() and np.isneginf(np.asarray(blocked)[0, 2, 80:]).all()
    assert int(live) == (3 if block_entries == 32 else 1)  # 80 entries seen: 3 blocks of 32


def test_blocks_past_the_visible_entries_are_not_scored(monkeypatch):
    """Pages past every query's visible entries are never read: NaN keys there change nothing."""
    monkeypatch.setattr(programs, "SCORE_BLOCK_ENTRIES", 32)
    B, C, P, E, r = 2, 8, 20, 16, 1
    q, w, pages, bt, rng = _pool(2, B, C, P, E)
    bt[:] = rng.permutation(P)[:B * C].reshape(B, C)  # every column names a real page
    cfg = _cfg(q)
    # scale 255 is UE8M0's NaN: a page whose keys all decode to NaN
    poisoned = pages.ik_scale.at[bt[:, 3:].reshape(-1)].set(255)
    bad = types.SimpleNamespace(ik_packed=pages.ik_packed, ik_scale=poisoned)

    def f(pg, pos):
        fn = jax.jit(lambda q, w, bt, pos: programs._context_select(q, w, pg, bt, pos, r, cfg, NUM,
                                                                   want_candidates=True))
        return [np.asarray(a) for a in fn(q, w, jnp.asarray(bt), pos)]

    # at most 31 entries: the first block (3 pages: twice the top-k of 24, in whole pages)
    near = jnp.asarray([[28, 29, 30], [0, 5, 9]], jnp.int32)
    for got, want in zip(f(bad, near), f(pages, near)):
        np.testing.assert_array_equal(got, want)
    # the same NaN pages inside the visible blocks do reach the selection (the test can fail)
    far = jnp.asarray([[100, 101, 102], [0, 5, 9]], jnp.int32)
    assert any((g != h).any() for g, h in zip(f(bad, far), f(pages, far)))


@pytest.mark.parametrize("S", [4, 1])  # a prefill chunk's queries / a decode step's (its own block size)
@pytest.mark.parametrize("with_candidates", [False, True])
def test_context_select_merges_blocks_as_one_selection(monkeypatch, with_candidates, S):
    """The XLA indexer's top-k, merged block by block (`_context_select`), picks `indexer.select_topk`'s entries
    of the one-pass scores: ties (coarse values make many) to the lower id, rows that see fewer than k entries or
    none, and candidate lists with fewer than k visible candidates (the -inf entries then picked by id)."""
    for name in ("SCORE_BLOCK_ENTRIES", "DECODE_SCORE_BLOCK_ENTRIES"):
        monkeypatch.setattr(programs, name, 32)  # 3 pages a block (2 x the top-k), 3 blocks
    B, C, P, E, r = 3, 8, 40, 16, 2
    q, w, pages, bt, rng = _pool(4, B, C, P, E, S=S)
    for i, n in enumerate((8, 3, 1)):
        bt[i, :n] = rng.permutation(P)[:n]
    pos = jnp.asarray([[255, 200, 130, 70], [95, 60, 20, 7], [1, 0, 0, 0]], jnp.int32)[:, :S]
    cfg = _cfg(q)
    G = C * E
    blocks = None
    if with_candidates:  # ascending block ids, -1 padded, as the candidate source hands them on
        pick = np.sort(rng.permuted(np.broadcast_to(np.arange(G // 8), (B, S, G // 8)), axis=-1)[..., :6], axis=-1)
        pick[1, :, 4:] = -1
        blocks = jnp.asarray(pick, jnp.int32)

    @jax.jit
    def both(q, w, bt, pos, blocks):
        got, _ = programs._context_select(q, w, pages, bt, pos, r, cfg, NUM, blocks)
        s = indexer.scores(q, w, programs._context_index_keys(pages, bt, cfg), pos, r, NUM)
        if blocks is not None:
            s = jnp.where(jnp.repeat(indexer.block_mask(blocks, G // 8), 8, axis=-1), s, -jnp.inf)
        return got, indexer.select_topk(s, pos, r, cfg)

    got, want = both(q, w, jnp.asarray(bt), pos, blocks)
    assert got.shape == (B, S, 24)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(want)[2] == -1).sum() > 0 and (np.asarray(want)[0, 0] >= 32).any()  # short rows, far blocks


@pytest.mark.parametrize("topk_blocks", [4, 64])  # the block top-k / every visible block (no top-k)
def test_candidate_blocks_from_block_maxima(monkeypatch, topk_blocks):
    """The candidate source's blocks, from the maxima of the blocks some query sees (`_context_select` with
    want_candidates), are `indexer.candidate_mask`'s entries of the one-pass scores; its own top-k is
    `select_topk`'s."""
    monkeypatch.setattr(programs, "SCORE_BLOCK_ENTRIES", 32)
    B, C, P, E, r = 3, 8, 40, 16, 1
    q, w, pages, bt, rng = _pool(5, B, C, P, E, S=4)
    for i, n in enumerate((8, 3, 1)):
        bt[i, :n] = rng.permutation(P)[:n]
    pos = jnp.asarray([[127, 100, 60, 33], [47, 30, 9, 7], [1, 0, 0, 0]], jnp.int32)
    cfg = _cfg(q, candidate_topk_blocks=topk_blocks)

    @jax.jit
    def both(q, w, bt, pos):
        topk, cand = programs._context_select(q, w, pages, bt, pos, r, cfg, NUM, want_candidates=True)
        s = indexer.scores(q, w, programs._context_index_keys(pages, bt, cfg), pos, r, NUM)
        mask = jnp.repeat(indexer.block_mask(cand, C * E // 8), 8, axis=-1)
        return topk, mask, indexer.select_topk(s, pos, r, cfg), indexer.candidate_mask(s, pos, r, cfg)

    topk, mask, want_topk, want_mask = both(q, w, jnp.asarray(bt), pos)
    np.testing.assert_array_equal(np.asarray(topk), np.asarray(want_topk))
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask))
    kept = np.asarray(want_mask).reshape(B, 4, -1, 8)[..., 0].sum(-1)
    assert (kept[0] == 4).all() if topk_blocks == 4 else kept[0, 0] == 16  # a top-k of 16 seen, or all 16
