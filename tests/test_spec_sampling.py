"""Speculative sampling (`serving.engine.spec_sampling.verify`) keeps the target's distribution: Monte Carlo over
40,000 rows with a target and a draft distribution that differ, each row's drafts drawn from the draft's; also
when rows verify only a prefix of their drafts (the confidence head's cut)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine import spec_sampling
from serving.engine.programs import Sampling

N, K, V = 40_000, 3, 6
TOL = 0.01  # 4 standard errors of a frequency near 0.5 at N rows


def _setup(top_k=0):
    rng = np.random.default_rng(0)
    target = rng.normal(size=(K + 1, V)).astype(np.float32) * 1.5  # the same at every row
    draft = rng.normal(size=(K, V)).astype(np.float32) * 1.5
    s = Sampling(jnp.ones(N), jnp.ones(N), jnp.full(N, top_k, jnp.int32),
                 jnp.asarray(np.stack([np.arange(N), np.full(N, 7)], 1), jnp.uint32))
    q = np.asarray(spec_sampling.probs(jnp.asarray(np.repeat(draft[None], N, 0).reshape(-1, V)),
                                       Sampling(*(jnp.repeat(a, K, 0) for a in (s.temperature, s.top_p, s.top_k)),
                                                jnp.zeros((N * K, 2), jnp.uint32)))).reshape(N, K, V)[0]
    drafts = np.stack([rng.choice(V, size=N, p=q[i] / q[i].sum()) for i in range(K)], 1).astype(np.int32)
    p = np.asarray(jax.nn.softmax(jnp.asarray(target), -1))
    if top_k:
        keep = np.argsort(-target, -1)[:, :top_k]
        p = np.zeros_like(p)
        for i in range(K + 1):
            e = np.exp(target[i, keep[i]] - target[i, keep[i]].max())
            p[i, keep[i]] = e / e.sum()
    target_rows = jnp.broadcast_to(jnp.asarray(target), (N, K + 1, V))
    # every array an argument: XLA:CPU would constant-fold a closed-over one's sorts (a minute a compile)
    run = jax.jit(lambda t, q, d, hq, s, n: spec_sampling.verify(t, d, lambda: jnp.broadcast_to(q, (N, K, V)), hq, s,
                                                                   n))

    def verify(d, hq, n=jnp.full(N, K, jnp.int32)):
        return run(target_rows, jnp.asarray(draft), d, hq, s, n)

    plain = np.asarray(spec_sampling.plain_draw(target_rows[:, 0], s, filtered=bool(top_k)))
    return p, drafts, verify, plain


def _emitted(m, bonus, drafts, j):
    """The j-th token a row emits (-1 where it emits fewer)."""
    tok = np.where(m > j, drafts[:, min(j, K - 1)], np.where(m == j, bonus, -1))
    return tok


def _freq(tok, mask):
    return np.bincount(tok[mask], minlength=V) / mask.sum()


def test_emitted_tokens_follow_the_target():
    p, drafts, verify, _ = _setup()
    m, bonus = (np.asarray(a) for a in verify(jnp.asarray(drafts), jnp.ones(N, bool)))
    assert 0 < (m == 0).mean() < 1 and (m == K).any()  # the draft is wrong often and right sometimes
    first = _emitted(m, bonus, drafts, 0)
    np.testing.assert_allclose(_freq(first, first >= 0), p[0], atol=TOL)
    # the j-th token, given that the step got that far, follows the target at position j
    for j in (1, 2):
        tok = _emitted(m, bonus, drafts, j)
        np.testing.assert_allclose(_freq(tok, m >= j), p[j], atol=TOL)


def test_a_cut_keeps_the_target():
    """Rows verify n of their K drafts: n from the first draft (a cut may read the drafts before the position
    it cuts: a row whose first draft is even verifies all, an odd one only that one), a tenth of the rows none.
    A row stops at its cut and takes p_n there (not the residual p_n - q_n): every emitted token still follows
    the target; the rows with n = 0 take their plain draw."""
    p, drafts, verify, plain = _setup()
    n = np.where(drafts[:, 0] % 2 == 0, K, 1).astype(np.int32)
    n[::10] = 0
    m, bonus = (np.asarray(a) for a in verify(jnp.asarray(drafts), jnp.ones(N, bool), jnp.asarray(n)))
    assert (m <= n).all() and ((m == n) & (n == 1)).any()
    assert (bonus[n == 0] == plain[n == 0]).all()
    for j in (0, 1):  # (few rows get further)
        tok = _emitted(m, bonus, drafts, j)
        np.testing.assert_allclose(_freq(tok, (m >= j) & (n > 0)), p[j], atol=TOL)
    cut = (n == 1) & (m == 1)  # the token at the cut: p_1 itself (4 standard errors at these rows)
    np.testing.assert_allclose(_freq(bonus, cut), p[1], atol=2 / np.sqrt(cut.sum()))


def test_top_k_filters_both_sides():
    p, drafts, verify, _ = _setup(top_k=3)
    m, bonus = (np.asarray(a) for a in verify(jnp.asarray(drafts), jnp.ones(N, bool)))
    first = _emitted(m, bonus, drafts, 0)
    np.testing.assert_allclose(_freq(first, first >= 0), p[0], atol=TOL)
    assert (p[0][first] > 0).all()


def test_rows_without_drafter_states_take_their_plain_draw():
    p, drafts, verify, plain = _setup()
    m, bonus = (np.asarray(a) for a in verify(jnp.asarray(drafts), jnp.zeros(N, bool)))
    assert (m == 0).all() and (bonus == plain).all()
    np.testing.assert_allclose(_freq(plain, plain >= 0), p[0], atol=TOL)


def _batch(temps, top_p, top_k):
    B = len(temps)
    return Sampling(jnp.asarray(temps, jnp.float32), jnp.asarray(top_p, jnp.float32), jnp.asarray(top_k, jnp.int32),
                    jnp.asarray(np.stack([np.arange(B), np.full(B, 5)], 1), jnp.uint32))


def test_a_row_verifies_alike_in_any_batch():
    """A step samples under one branch of the whole batch (`spec_sampling.batch_branch`): all greedy, some row drawing,
    some row filtering. A row's tokens may not depend on which branch its batch took: a greedy row takes the
    target's argmax and a drawing row that does not filter the same draws whether or not another row filters."""
    rng = np.random.default_rng(1)
    B = 4
    target = jnp.asarray(rng.normal(size=(B, K + 1, V)) * 2, jnp.float32)
    draft = jnp.asarray(rng.normal(size=(B, K, V)) * 2, jnp.float32)
    drafts = jnp.asarray(rng.integers(0, V, (B, K)), jnp.int32)
    run = jax.jit(lambda s: spec_sampling.verify(target, drafts, lambda: draft, jnp.ones(B, bool), s,
                                                 jnp.full(B, K, jnp.int32)) + (spec_sampling.batch_branch(s),))
    greedy = run(_batch([0.0] * B, [1.0] * B, [0] * B))
    drawn = run(_batch([0.0, 2.0, 2.0, 0.0], [1.0] * B, [0] * B))
    filtered = run(_batch([0.0, 2.0, 2.0, 2.0], [1.0] * B, [0, 0, 0, 2]))
    assert [int(r[2]) for r in (greedy, drawn, filtered)] == list(spec_sampling.BRANCHES)
    for rows, a, b in (([0, 3], greedy, drawn), ([0], greedy, filtered), ([1, 2], drawn, filtered)):
        for x, y in zip(a[:2], b[:2]):
            np.testing.assert_array_equal(np.asarray(x)[rows], np.asarray(y)[rows])
    target_argmax = np.asarray(target).argmax(-1)
    m, bonus = (np.asarray(a) for a in greedy[:2])
    assert (bonus == target_argmax[np.arange(B), m]).all()
    # the branch the host picks (`SpeculativeConfig.greedy_program`): FILTERED gives any batch the switch's tokens
    static = jax.jit(lambda s, branch: spec_sampling.verify(target, drafts, lambda: draft, jnp.ones(B, bool), s,
                                                            jnp.full(B, K, jnp.int32), branch), static_argnums=1)
    for temps, top_k, by_switch in (([0.0] * B, [0] * B, greedy), ([0.0, 2.0, 2.0, 0.0], [0] * B, drawn)):
        for branch in (spec_sampling.FILTERED, spec_sampling.batch_branch(_batch(temps, [1.0] * B, top_k)).item()):
            for x, y in zip(static(_batch(temps, [1.0] * B, top_k), branch), by_switch[:2]):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
