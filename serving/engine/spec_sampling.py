"""Sampling for speculative decoding: the one top-k / top-p filter (plain steps use it too), each row's sampling
distribution, and the verification of a block of drafts that keeps every emitted token distributed as the target
model's (speculative sampling: Leviathan et al. 2023, Chen et al. 2023).

Greedy rows (temperature 0) accept the longest prefix of drafts equal to the target's argmax, then take the
target's argmax after it. A sampled row's draft d_i was drawn from the draft distribution q_i (the drafter's
logits under the row's temperature / top-k / top-p); it is accepted with probability min(1, p_i(d_i) / q_i(d_i))
(p_i: the target's distribution under the same filters); at the first rejection the row draws from the residual
max(0, p_i - q_i) (renormalized), and when all k are accepted from p_k. The emitted tokens are then distributed as
k + 1 plain sampling steps would emit them.

A row may verify only its first n <= k drafts (n [B]: `speculative.verify_lengths`, from the drafter's
confidence head): drafts past n are never accepted, and a row that accepts all n takes the token after them from
p_n, as if it had drafted n. The emitted tokens keep the target's distribution because the cut at each position
j is a function of what was fixed before d_j was drawn (the accepted prefix d_1 .. d_{j-1} and the drafter's
states): given the prefix, a verified position emits p_j (the rejection step above), a cut one draws from p_j
directly, and the choice between the two does not depend on d_j. By induction over positions every emitted
token is distributed as the target's given the tokens before it. Greedy rows accept min(n, the matching prefix)
and take the target's argmax there: the plain step's token. A row with n = 0 is a plain step (its token is
`plain_draw`'s at the anchor, as a plain step would draw it).

Random numbers come from each row's per-step key (`programs.Sampling.key`) folded with fixed offsets, so a seeded
request repeats. Shapes: B rows, k drafts, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# fold_in offsets of a row's step key: one stream per use
_ACCEPT, _RESIDUAL, _DRAFT = 100, 200, 300


def filter_top_k_top_p(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """z [B, V] (temperature-scaled logits) with -inf outside each row's top_k [B] (0: off) and its top_p [B]
    nucleus (1: off)."""
    srt = jnp.sort(z, -1)[:, ::-1]
    V = z.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], -1)
    z = jnp.where(z < kth, -jnp.inf, z)
    probs = jax.nn.softmax(jnp.where(srt < kth, -jnp.inf, srt), -1)
    cum = jnp.cumsum(probs, -1) - probs  # mass strictly above each sorted entry
    keep_sorted = (cum < top_p[:, None]) | (top_p[:, None] >= 1.0)
    cutoff = jnp.min(jnp.where(keep_sorted, srt, jnp.inf), -1, keepdims=True)
    return jnp.where(z < cutoff, -jnp.inf, z)


# A batch's sampling branch (`batch_branch`): every row greedy; some row draws and none filters; a drawing row filters
GREEDY, DRAWN, FILTERED = BRANCHES = (0, 1, 2)


def row_branches(s) -> tuple:
    """-> (the rows that draw, the drawing rows that filter by top-k / top-p), bool [B] each; numpy arrays for
    host sampling values (the engine picks `programs.sample`'s variant from them), jax arrays inside a program."""
    sampled = s.temperature > 0
    return sampled, sampled & ((s.top_k > 0) | (s.top_p < 1.0))


def batch_branch(s) -> jax.Array:
    """The batch's sampling branch (GREEDY, DRAWN, FILTERED), an int32 scalar. Where the host does not pick the
    branch (`SpeculativeConfig.greedy_program`), a speculative step samples under one `lax.switch` on it where it
    verifies and one where it drafts: XLA's GPU backend copies a branch index to the host before it can go on (a
    host round trip), so two indices a step rather than one per draw. FILTERED serves every row: the filter leaves
    a row with neither top-k nor top-p as it is."""
    sampled, filters = row_branches(s)
    return jnp.where(jnp.any(filters), FILTERED, jnp.where(jnp.any(sampled), DRAWN, GREEDY)).astype(jnp.int32)


def _scaled(logits: jax.Array, s, filtered: bool) -> jax.Array:
    """logits [B, V] / each row's temperature, filtered by its top-k / top-p where filtered (float32)."""
    z = logits.astype(jnp.float32) / jnp.maximum(s.temperature, 1e-5)[:, None]
    return filter_top_k_top_p(z, s.top_k, s.top_p) if filtered else z


def probs(logits: jax.Array, s, filtered: bool = True) -> jax.Array:
    """logits [B, V] -> each sampled row's sampling distribution float32 [B, V] (s: `programs.Sampling`; rows at
    temperature 0 get a distribution too, which their callers do not use). filtered False: no row of s filters
    (the filter would leave every row as it is)."""
    return jax.nn.softmax(_scaled(logits, s, filtered), -1)


def plain_draw(logits: jax.Array, s, filtered: bool) -> jax.Array:
    """A plain step's draw: logits [B, V] -> one id a row int32 [B] from its temperature-scaled (filtered) logits
    with the row's step key (rows at temperature 0 get one too, which their callers do not use)."""
    keys = jax.vmap(jax.random.wrap_key_data)(s.key)
    return jax.vmap(jax.random.categorical)(keys, _scaled(logits, s, filtered)).astype(jnp.int32)


def _keys(s, offset: int):
    return jax.vmap(lambda k: jax.random.fold_in(jax.random.wrap_key_data(k), offset))(s.key)


def draw(p: jax.Array, s, offset: int) -> jax.Array:
    """One id a row from p [B, V] with the row's key folded with `offset` -> int32 [B]."""
    logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)
    return jax.vmap(jax.random.categorical)(_keys(s, offset), logp).astype(jnp.int32)


def draft_sampler(s, filtered: bool):
    """The drafter's `sample(logits [B, V], i)` for block position i in a batch where some row draws: argmax on
    greedy rows, a draw from the row's distribution (filtered: `probs`) on sampled ones."""
    sampled = s.temperature > 0

    def sample(logits, i):
        drawn = draw(probs(logits, s, filtered), s, _DRAFT + i)
        return jnp.where(sampled, drawn, jnp.argmax(logits, -1).astype(jnp.int32))

    return sample


def verify(target_logits: jax.Array, drafts: jax.Array, draft_logits_fn, has_q: jax.Array, s,
           n_verify: jax.Array, branch: int | None = None) -> tuple[jax.Array, jax.Array]:
    """target_logits [B, k + 1, V] (after the anchor and after each draft), drafts [B, k]; draft_logits_fn() ->
    the logits [B, k, V] the drafts were drawn from (called only in a batch where some row draws); has_q [B]: the
    row's drafts were drawn by the drafter (else, e.g. the first step after a prefill, a sampled row accepts
    none and takes its plain step's draw at the anchor, `plain_draw`); n_verify [B] (0 .. k): the drafts each
    row verifies, the rest cut (the module's docstring). -> (accepted drafts m [B], the token after them [B]).
    branch: the batch's sampling branch where the caller knows it (GREEDY: every row greedy; FILTERED serves any
    batch), no switch; None: one `lax.switch` on the batch's `batch_branch` (an all-greedy batch computes no
    distribution)."""
    B, k1, V = target_logits.shape
    k = k1 - 1
    verified = jnp.arange(k, dtype=jnp.int32)[None] < n_verify[:, None]  # [B, k]
    target = jnp.argmax(target_logits, -1).astype(jnp.int32)
    match = (drafts == target[:, :k]) & verified
    m_greedy = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    bonus_greedy = jnp.take_along_axis(target, m_greedy[:, None], axis=1)[:, 0]
    if branch == GREEDY:
        return m_greedy, bonus_greedy
    sampled = s.temperature > 0
    spec = sampled & has_q & (n_verify > 0)

    def rejection(filtered: bool):
        dist = jax.vmap(lambda lg: probs(lg, s, filtered), in_axes=1, out_axes=1)
        p = dist(target_logits)  # [B, k + 1, V]
        q = dist(draft_logits_fn())  # [B, k, V]
        pd = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]
        qd = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
        u = jnp.stack([jax.vmap(jax.random.uniform)(_keys(s, _ACCEPT + i)) for i in range(k)], 1)  # [B, k]
        ok = (u * qd < pd) & verified  # u < p/q without dividing (q(d) > 0: d was drawn from q)
        m = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        p_m = jnp.take_along_axis(p, m[:, None, None], axis=1)[:, 0]
        q = jnp.where(verified[..., None], q, 0.0)  # q = 0 at the cut: all n accepted draws from p_n
        q_m = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), m[:, None, None], axis=1)[:, 0]
        res = jnp.maximum(p_m - q_m, 0.0)
        mass = jnp.sum(res, -1, keepdims=True)
        res = jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), p_m)
        first = plain_draw(target_logits[:, 0], s, filtered)
        m = jnp.where(spec, m, jnp.where(sampled, 0, m_greedy))
        bonus = jnp.where(spec, draw(res, s, _RESIDUAL), jnp.where(sampled, first, bonus_greedy))
        return m, bonus

    if branch is not None:
        return rejection(branch == FILTERED)
    return jax.lax.switch(batch_branch(s), [lambda: (m_greedy, bonus_greedy), lambda: rejection(False),
                                            lambda: rejection(True)])
