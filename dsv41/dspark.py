"""DSpark, V4.1's own drafter (spec §2.8): `n_mtp_layers` stages (release keys `mtp.{s}.*`) that draft a block of
`dspark_block_size` tokens at once from the target model's features.

The pieces, in the order they run (axis letters: B batch, S target positions, T context keys, K block size
(5 in Flash), D model width, V vocabulary, R Markov rank):

1. `target_features`: the streams entering the target layers (`dspark_target_layer_ids`, the blocks' inputs after
   any Engram) averaged over the hc copies and concatenated -> [B, S, n*D].
2. `project_context`: stage 0's `main_norm(main_proj(.))` -> the context states [B, S, D].
3. `context_kv`: each stage's window K=V of the context states at their positions (its own wkv / kv_norm, RoPE
   without YaRN, FP8 round trip as the main model's window cache) -> per stage [B, S, Dh]. A serving engine keeps
   the newest `window_size` of these in a ring; a block only reads positions [anchor - window, anchor).
4. `draft_states`: the block's input ids are [anchor token, noise x (K-1)] at positions anchor .. anchor+K-1;
   embedded (the target's embedding) into hc copies, run through the stages (each `model.block` with its own
   mHC, window attention over its context keys plus the whole block (bidirectional), top-k of its own experts),
   collapsed and normalized by the last stage's norm -> [B, K, D].
5. `draft_logits`: the target's head over those states plus the rank-R Markov bias of each position's previous
   token, and the confidence head's logit (float32) -> logits [B, K, V], confidence [B, K]. `draft_tokens` runs
   the head over the block at once and the bias sequentially, the previous token of position i being the token
   drafted at i-1 (the anchor at 0).

The reference is nemo-automodel's `deepseek_v41/dspark.py` (tests/test_dspark_reference.py compares against it).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import attention as attn_lib
from dsv41 import mhc, model, rope
from dsv41.config import ModelConfig
from dsv41.nn import linear, linear_f32, rms_norm
from dsv41.ops import XLA, Ops
from dsv41.quant import Numerics


def stage_freqs(cfg: ModelConfig) -> list[np.ndarray]:
    """RoPE frequencies of each stage (layers n_layers.., window-only: theta=rope_theta, no YaRN)."""
    return [rope.inv_freq(cfg, cfg.n_layers + s) for s in range(cfg.n_mtp_layers)]


def target_features(block_ins: Sequence[jax.Array]) -> jax.Array:
    """The target layers' block inputs, each [B, S, hc, D] -> [B, S, n*D]: each one's mean over the hc copies
    (float32 sum, rounded to the stream's dtype), concatenated in layer order."""
    means = [jnp.mean(h.astype(jnp.float32), axis=-2).astype(h.dtype) for h in block_ins]
    return jnp.concatenate(means, axis=-1)


def project_context(params: dict, feats: jax.Array, cfg: ModelConfig, num: Numerics, ops: Ops = XLA) -> jax.Array:
    """feats [B, S, n*D] -> context states [B, S, D]: stage 0's main_norm(main_proj(feats))."""
    p0 = params["mtp"][0]
    return rms_norm(ops.linear(feats, p0["main_proj"], num, fp8_input=True), p0["main_norm"], cfg.norm_eps)


def context_kv(params: dict, ctx: jax.Array, pos: jax.Array, cfg: ModelConfig, num: Numerics,
               ops: Ops = XLA) -> list[jax.Array]:
    """Context states [B, S, D] at positions pos [B, S] -> each stage's window keys (= values) [B, S, Dh]."""
    return [attn_lib.window_kv(ctx, sp["attn"], pos, f, cfg, num, ops=ops)
            for sp, f in zip(params["mtp"], stage_freqs(cfg))]


def block_ids(anchor_ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """anchor_ids [B] -> the block's input ids [B, K]: the anchor, then the noise token."""
    noise = jnp.full((anchor_ids.shape[0], cfg.dspark_block_size - 1), cfg.dspark_noise_token_id, jnp.int32)
    return jnp.concatenate([anchor_ids.astype(jnp.int32)[:, None], noise], axis=1)


def _attention(x: jax.Array, p: dict, ctx_k: jax.Array, ctx_pos: jax.Array, pos: jax.Array, freqs: np.ndarray,
               cfg: ModelConfig, num: Numerics, ops: Ops) -> jax.Array:
    """One stage's attention. x [B, K, D] (attn_norm'd) at pos [B, K] (anchor .. anchor+K-1); ctx_k [B, T, Dh] at
    ctx_pos [B, T] (attn_lib.NO_POS: empty). Each block query sees the context positions [anchor - window, anchor)
    and every key of its own block. -> [B, K, D]."""
    q, _ = attn_lib.project_q(x, p, pos, freqs, cfg, num, ops=ops)
    own_k = attn_lib.window_kv(x, p, pos, freqs, cfg, num, ops=ops)
    anchor = pos[:, :1]
    seen = (ctx_pos < anchor) & (ctx_pos >= anchor - cfg.window_size)  # [B, T]
    K = x.shape[1]
    mask = jnp.concatenate([jnp.broadcast_to(seen[:, None, :], (*pos.shape, seen.shape[1])),
                            jnp.ones((*pos.shape, K), bool)], axis=-1)
    keys = jnp.concatenate([ctx_k.astype(own_k.dtype), own_k], axis=1)
    key_pos = jnp.concatenate([ctx_pos, pos], axis=1)
    o = attn_lib.attend(q, pos, keys, key_pos, None, None, p["attn_sink"], cfg, num, win_mask=mask)
    return attn_lib.output(o, pos, p, freqs, cfg, num, ops=ops)


def draft_states(params: dict, ctx_k: Sequence[jax.Array], ctx_pos: jax.Array, anchor_ids: jax.Array,
                 anchor_pos: jax.Array, cfg: ModelConfig, num: Numerics, ops: Ops = XLA,
                 trace: dict | None = None) -> jax.Array:
    """The stages over one block per row. ctx_k: per stage [B, T, Dh] (`context_kv`, or a ring of them) at
    ctx_pos [B, T]; anchor_ids, anchor_pos [B]: the last token known and its position. -> the last stage's
    normalized states [B, K, D]."""
    K = cfg.dspark_block_size
    pos = anchor_pos.astype(jnp.int32)[:, None] + jnp.arange(K, dtype=jnp.int32)
    h, pre = model.embed(params, block_ids(anchor_ids, cfg), cfg, num)
    scfg = cfg.dspark_stage_config
    for s, (sp, freqs) in enumerate(zip(params["mtp"], stage_freqs(cfg))):
        def attn_fn(x, state, sp=sp, s=s, freqs=freqs):
            return _attention(x, sp["attn"], ctx_k[s], ctx_pos, pos, freqs, cfg, num, ops), state

        h, pre, _ = model.block(h, pre, sp, cfg.n_layers + s, scfg, num, attn_fn, None, trace, ops=ops)
    return rms_norm(mhc.collapse(h, pre), params["mtp"][-1]["norm"], cfg.norm_eps)


def draft_logits(params: dict, states: jax.Array, prev_ids: jax.Array, cfg: ModelConfig,
                 num: Numerics) -> tuple[jax.Array, jax.Array]:
    """states [..., D] (`draft_states`) and each position's previous token prev_ids [...] -> (float32 logits
    [..., V]: the target's head plus the Markov bias of the previous token; float32 confidence logits [...])."""
    return _biased(params, head_logits(params, states), states, prev_ids, num)


def _biased(params: dict, head_logits: jax.Array, states: jax.Array, prev_ids: jax.Array,
            num: Numerics) -> tuple[jax.Array, jax.Array]:
    """`draft_logits` from the states' head logits [..., V] (float32), computed already."""
    last = params["mtp"][-1]
    emb = jnp.take(last["markov_head"]["embed"], prev_ids, axis=0).astype(num.jdtype)  # [..., R]
    bias = linear(emb, last["markov_head"]["head"], num, fp8_input=False).astype(jnp.float32)
    conf = linear_f32(jnp.concatenate([states.astype(jnp.float32), emb.astype(jnp.float32)], axis=-1),
                      last["confidence_head"]["proj"])[..., 0]
    return head_logits + bias, conf


def greedy(logits: jax.Array, i: int) -> jax.Array:
    """The draft sampler of greedy decoding: logits [B, V] of block position i -> ids [B]."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def head_logits(params: dict, states: jax.Array) -> jax.Array:
    """states [..., D] -> the target's head over them, float32 [..., V] (the step's largest weight, read once a
    block: no position's head reads the previous token)."""
    return linear_f32(states, params["head"])


def draft_tokens(params: dict, states: jax.Array, anchor_ids: jax.Array, cfg: ModelConfig, num: Numerics,
                 sample: Callable[[jax.Array, int], jax.Array] = greedy):
    """Drafts one block sequentially: position i's Markov bias reads the token drafted at i-1 (the anchor at 0).
    states [B, K, D], anchor_ids [B] -> (draft ids [B, K], their logits [B, K, V], confidence logits [B, K]).
    sample(logits [B, V], i) -> ids [B] picks each token (default: argmax)."""
    return draft_from_head(params, head_logits(params, states), states, anchor_ids, num, sample)


def draft_from_head(params: dict, head: jax.Array, states: jax.Array, anchor_ids: jax.Array, num: Numerics,
                    sample: Callable[[jax.Array, int], jax.Array] = greedy):
    """`draft_tokens` with the states' `head_logits` head [B, K, V] computed already (a caller that branches on
    its sampling runs the head once, before the branches)."""
    prev = anchor_ids.astype(jnp.int32)
    toks, logits, confs = [], [], []
    for i in range(states.shape[1]):
        lg, cf = _biased(params, head[:, i], states[:, i], prev, num)
        prev = sample(lg, i)
        toks.append(prev)
        logits.append(lg)
        confs.append(cf)
    return jnp.stack(toks, 1), jnp.stack(logits, 1), jnp.stack(confs, 1)
