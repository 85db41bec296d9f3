"""The V4.1 text model over a full sequence: embedding, 4-stream mHC blocks with Engram, CSA2 attention and
MoE, final collapse and head (spec §2). This is the exact path: no cache, no replay. The engine
(serving/engine) runs the same layer pieces against a paged KV pool.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import attention as attn_lib
from dsv41 import compressor, engram, indexer, layer_runs, mhc, moe, quant, rope, vision
from dsv41.config import ConfigError, ModelConfig
from dsv41.layer_plan import Carry, LayerPlan
from dsv41.nn import linear_f32, rms_norm
from dsv41.ops import XLA, Ops
from dsv41.params import VISION_KEYS
from dsv41.quant import Numerics


class InputError(ValueError):
    """Bad token ids or shapes handed to the model."""


def check_tokens(token_ids, cfg: ModelConfig) -> np.ndarray:
    """Validates token ids on the host, before anything is traced. -> int32 [B, S]."""
    ids = np.asarray(token_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise InputError(f"token_ids must be [batch, seq], got shape {ids.shape}")
    if ids.size == 0 or ids.shape[1] == 0:
        raise InputError(f"token_ids is empty (shape {ids.shape}): give at least one token")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"token_ids must be integers, got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= cfg.vocab_size)
    if bad.any():
        b, s = np.argwhere(bad)[0]
        raise InputError(f"token id {int(ids[b, s])} at [{b}, {s}] is outside the vocabulary [0, {cfg.vocab_size})")
    if ids.shape[1] > cfg.max_seq_len:
        raise InputError(f"sequence of {ids.shape[1]} tokens exceeds max_seq_len={cfg.max_seq_len}")
    return ids.astype(np.int32)


def freqs_for(cfg: ModelConfig) -> list[np.ndarray]:
    return [rope.inv_freq(cfg, i) for i in range(cfg.n_layers)]


def attention_full(x: jax.Array, p: dict, layer: int, cfg: ModelConfig, num: Numerics, carry: Carry,
                   pos: jax.Array, freqs: np.ndarray, trace: dict | None = None,
                   ops: Ops = XLA, layer_name: int | None = None) -> tuple[jax.Array, Carry]:
    """One layer's attention over a whole sequence. x [B, S, D] (attn_norm'd), pos [B, S] = arange. layer: any
    layer of its body (`layer_runs`: the static plan); layer_name: the layer itself, for the trace (default layer).

    `carry` holds what earlier layers handed on (`layer_plan.Carry`: compressed KV and index keys of the latest
    KV source, the latest top-k, the candidate mask). -> (output [B, S, D], the carry for the next layer)."""
    plan, r = LayerPlan.of(cfg, layer), cfg.compress_ratios[layer]
    layer = layer if layer_name is None else layer_name
    q, qr = attn_lib.project_q(x, p, pos, freqs, cfg, num, ops=ops)
    kv = attn_lib.window_kv(x, p, pos, freqs, cfg, num, ops=ops)
    comp_k = comp_valid = None
    if not plan.swa_only:
        if plan.writes_kv:
            latent = compressor.compress(x, p["compressor"], r, cfg, num)
            gpos = jnp.broadcast_to(jnp.arange(latent.shape[1], dtype=jnp.int32) * r, latent.shape[:2])
            carry = dataclasses.replace(carry, index_k=indexer.index_keys(latent, p["indexer"], gpos, freqs, cfg, num),
                                        comp_kv=attn_lib.compressed_entries(latent, gpos, freqs, num))
            if trace is not None:
                trace[f"layer{layer}.latent"] = latent
        if plan.runs_indexer:
            qi, wi = indexer.index_queries(x, qr, p["indexer"], pos, freqs, cfg, num, ops=ops)
            s = indexer.scores(qi, wi, carry.index_k, pos, r, num)
            if plan.makes_candidates:
                carry = dataclasses.replace(carry, cand_mask=indexer.candidate_mask(s, pos, r, cfg))
                if trace is not None:
                    trace[f"layer{layer}.candidates"] = carry.cand_mask
            elif plan.uses_candidates:
                s = jnp.where(carry.cand_mask, s, -jnp.inf)
            carry = dataclasses.replace(carry, topk=indexer.select_topk(s, pos, r, cfg))
            if trace is not None:
                trace[f"layer{layer}.index_scores"] = s
                trace[f"layer{layer}.topk"] = carry.topk
        comp_k, comp_valid = attn_lib.gather_entries(carry.comp_kv, carry.topk)
    o = attn_lib.attend(q, pos, kv, pos, comp_k, comp_valid, p["attn_sink"], cfg, num)
    return attn_lib.output(o, pos, p, freqs, cfg, num, ops=ops), carry


def block(h: jax.Array, pre_mix: jax.Array, p: dict, layer: int, cfg: ModelConfig, num: Numerics, attn_fn,
          state: Any = None, trace: dict | None = None, image_mask=None, ops: Ops = XLA):
    """One mHC block with the delayed pre-mix: attention reads the copies through `pre_mix` (from the previous
    block's FFN site); the FFN reads them through the attention site's `pre`. -> (h', ffn pre, state').
    attn_fn(x [B, S, D], state) -> (y [B, S, D], state'): the attention and whatever it threads from layer to
    layer (the full-sequence model: a `layer_plan.Carry`; the engine: the KV pool and the carry).
    ops: which code runs the mHC sites, the linears and the MoE (`dsv41.ops`)."""
    # named scopes label the compiled program's ops by model part (scripts/profile_step.py sums kernels by them)
    def site(y, h, post, comb, pre, name, norm):
        return ops.mhc_site(y, h, post, comb, pre, p[f"hc_{name}_fn"], p[f"hc_{name}_scale"],
                            p[f"hc_{name}_base"], p[norm], cfg)

    with jax.named_scope("mhc"):
        _, x, a_pre, a_post, a_comb = site(None, h, None, None, pre_mix, "attn", "attn_norm")
    with jax.named_scope("attention"):
        y, state = attn_fn(x, state)
    with jax.named_scope("mhc"):
        h1, x, f_pre, f_post, f_comb = site(y, h, a_post, a_comb, a_pre, "ffn", "ffn_norm")
    with jax.named_scope("moe"):
        z, routing = moe.moe(x, p["ffn"], cfg, num, image_mask, return_routing=True, ops=ops)
    with jax.named_scope("mhc"):
        h2 = mhc.expand(z, h1, f_post, f_comb)
    if trace is not None:
        trace.update({
            f"layer{layer}.block_in": h, f"layer{layer}.pre_mix_in": pre_mix, f"layer{layer}.attn_out": y,
            f"layer{layer}.mid": h1, f"layer{layer}.ffn_in": x, f"layer{layer}.pre_mix_out": f_pre,
            f"layer{layer}.ffn_out": z, f"layer{layer}.block_out": h2,
            f"layer{layer}.hc_attn_pre": a_pre, f"layer{layer}.hc_attn_post": a_post,
            f"layer{layer}.hc_attn_comb": a_comb, f"layer{layer}.moe.weights": routing[0],
            f"layer{layer}.moe.experts": routing[1],
        })
    return h2, f_pre, state


def embed(params: dict, ids: jax.Array, cfg: ModelConfig, num: Numerics) -> tuple[jax.Array, jax.Array]:
    """ids [B, S] -> 4 copies [B, S, hc, D] and the initial pre-mix (reads copy 0)."""
    h = jnp.take(params["embed"], ids, axis=0)
    h = quant.dense(h, num.jdtype) if quant.is_quantized(h) else h.astype(num.jdtype)
    h = jnp.broadcast_to(h[..., None, :], (*h.shape[:-1], cfg.hc_mult, cfg.dim))
    pre = jnp.zeros((*ids.shape, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    return h, pre


def head(params: dict, h: jax.Array, pre_mix: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final collapse through the last FFN's pre-mix, norm, float32 head -> logits [..., vocab]
    (`nn.linear_f32`: exact bf16 terms on tensor cores, the head read once)."""
    x = rms_norm(mhc.collapse(h, pre_mix), params["norm"], cfg.norm_eps)
    return linear_f32(x, params["head"])


# The params-tree key of a loaded checkpoint's Engram compressed token map (int64 [vocab], host, read-only:
# `tokenizer.build_compressed_token_map` of the checkpoint's own tokenizer). It travels with the weights so that a
# loaded model hashes its n-grams with its own tokenizer's classes; `hasher_for` reads it, `strip_tables` drops it
# (the programs never see it). A tree without it (presets, init_params) hashes with the built-in tokenizer.
TOKEN_MAP_KEY = "engram_token_map"


def strip_tables(params: dict) -> tuple[dict, list]:
    """Splits the Engram tables (host-resident, read by row) and the token map (`TOKEN_MAP_KEY`) from the rest of
    the tree the programs take: per layer, or grouped by run (`layer_runs.stack_params`: an Engram layer is a run
    of one, its dict as it was). -> (the tree, the tables in layer order)."""
    params = {k: v for k, v in params.items() if k != TOKEN_MAP_KEY}
    key = layer_runs.RUNS_KEY if layer_runs.RUNS_KEY in params else "layers"
    tables = []

    def strip(lp: dict) -> dict:
        if "engram" not in lp:
            return lp
        e = dict(lp["engram"])
        tables.append(e.pop("embed"))
        return {**lp, "engram": e}

    groups = [[strip(lp) for lp in g] if isinstance(g, list) else strip(g) for g in params[key]]
    return {**params, key: groups}, tables


def engram_rows(tables: list, hash_ids: np.ndarray) -> list:
    """hash ids [B, S, n_engram_layers, n_cols] -> per Engram layer rows [B, S, n_cols, d] (FP8, as stored)."""
    return [engram.gather_rows(t, hash_ids[:, :, i]) for i, t in enumerate(tables)]


def place_images(h: jax.Array, image_embeds: jax.Array | None, image_mask: jax.Array | None) -> jax.Array:
    """The 4 copies [B, S, hc, D] with the image spans' rows (image_embeds [B, S, D], read where image_mask
    [B, S]) in place of the image tokens' embeddings."""
    if image_embeds is None:
        return h
    return jnp.where(image_mask[:, :, None, None], image_embeds[:, :, None, :].astype(h.dtype), h)


@functools.partial(jax.jit, static_argnames=("cfg", "num", "with_trace", "ops"))
def _forward(params: dict, ids: jax.Array, rows: list, cfg: ModelConfig, num: Numerics, with_trace: bool = False,
             ops: Ops = XLA, image_embeds: jax.Array | None = None, image_mask: jax.Array | None = None):
    B, S = ids.shape
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    freqs = freqs_for(cfg)
    trace: dict[str, Any] | None = {} if with_trace else None
    h, pre = embed(params, ids, cfg, num)
    h = place_images(h, image_embeds, image_mask)
    text_mask = None if image_mask is None else ~image_mask
    carry = Carry()
    groups = layer_runs.stack_params(params, cfg, stack=False)[layer_runs.RUNS_KEY]  # a per-layer tree: unrolled
    for r, run in enumerate(layer_runs.runs(cfg)):
        def body(state, lp, i, run):
            h, pre, carry = state
            if run.n == 1 and i in cfg.engram_layer_ids:  # (an Engram layer is a run of one: i is static)
                if trace is not None:
                    trace[f"layer{i}.block_in_raw"] = h
                h = engram.engram(h, rows[cfg.engram_layer_ids.index(i)], lp["engram"], cfg, num, text_mask, ops=ops)
                if trace is not None:
                    trace[f"engram{i}.out"] = h

            def attn_fn(x, carry):
                return attention_full(x, lp["attn"], run.plan.layer, cfg, num, carry, pos, freqs[run.plan.layer],
                                      trace, ops, layer_name=i)

            return block(h, pre, lp, i, cfg, num, attn_fn, carry, trace, image_mask, ops=ops), None

        (h, pre, carry), _ = layer_runs.scan(body, (h, pre, carry), run, groups[r], unroll=trace is not None)
    logits = head(params, h, pre, cfg)
    return (logits, trace) if with_trace else logits


@functools.lru_cache(maxsize=4)
def builtin_hasher(cfg: ModelConfig):
    """The Engram hasher of the built-in tokenizer (the tiny preset's). For a preset with a larger vocabulary
    (bench, flash: random weights, ids the built-in tokenizer never emits) the ids past the tokenizer's get
    classes round-robin over the rest of the compressed vocabulary, so the hasher has the config's sizes."""
    from dsv41 import ngram_hash, tokenizer

    base, n = tokenizer.builtin_compressed_token_map()
    extra = cfg.vocab_size - base.shape[0]
    if extra > 0 and cfg.engram_compressed_vocab_size > n:
        rest = n + np.arange(extra) % (cfg.engram_compressed_vocab_size - n)
        base = np.concatenate([base, rest.astype(base.dtype)])
    return ngram_hash.NgramHasher(cfg, base)


# (cfg, id(token map)) -> (the map, its hasher); the entry holds the map, so its id is not reused while cached
_HASHERS: dict[tuple[ModelConfig, int], tuple[np.ndarray, Any]] = {}


def hasher_for(params: dict, cfg: ModelConfig):
    """The Engram n-gram hasher of a params tree: from its `TOKEN_MAP_KEY` entry (a loaded checkpoint, built once
    per map and cached), else the built-in tokenizer's (`builtin_hasher`); None for a model without Engram."""
    if not cfg.engram_layer_ids:
        return None
    token_map = params.get(TOKEN_MAP_KEY)
    if token_map is None:
        try:
            return builtin_hasher(cfg)
        except ConfigError as e:
            raise ConfigError(f"{e}. These params carry no {TOKEN_MAP_KEY!r} (the checkpoint's tokenizer classes), so "
                              "the built-in tokenizer's were tried: load the model with dsv41.load_checkpoint from a "
                              "directory holding its tokenizer.json, or pass hasher=ngram_hash.NgramHasher(cfg, "
                              "tokenizer.build_compressed_token_map(tok)[0])") from None
    key = (cfg, id(token_map))
    hit = _HASHERS.get(key)
    if hit is None:
        from dsv41 import ngram_hash

        if len(_HASHERS) >= 4:  # a few models per process at most; the oldest goes
            del _HASHERS[next(iter(_HASHERS))]
        hit = _HASHERS[key] = (token_map, ngram_hash.NgramHasher(cfg, token_map))
    return hit[1]


@dataclasses.dataclass(frozen=True)
class ImagePlacement:
    """One image of a forward: its prepared tower inputs and where its span starts (row `batch`, position
    `start`; the span's tokens must all be the image token)."""

    batch: int
    start: int
    inputs: Any  # image_processing.VisionInputs


def image_rows(params: dict, cfg: ModelConfig, ids: np.ndarray, images, num: Numerics):
    """The image spans of a batch: (rows [B, S, D] with each span's embeddings in place, mask bool [B, S]), or
    (None, None) without images. Each image runs through the vision program (`vision.image_span`) once."""
    if not images:
        return None, None
    B, S = ids.shape
    mask = np.zeros((B, S), bool)
    rows = jnp.zeros((B, S, cfg.dim), num.jdtype)
    for im in images:
        n = im.inputs.span_len
        if not (0 <= im.batch < B and 0 <= im.start and im.start + n <= S):
            raise InputError(f"an image span of {n} tokens at [{im.batch}, {im.start}] does not fit the token ids "
                             f"of shape {ids.shape}")
        span = slice(im.start, im.start + n)
        if (ids[im.batch, span] != cfg.image_token_id).any() or mask[im.batch, span].any():
            raise InputError(f"the span at [{im.batch}, {im.start}:{im.start + n}] must hold only the image token "
                             f"{cfg.image_token_id} and no other image; expand the prompt with "
                             "image_processing.expand_spans")
        mask[im.batch, span] = True
        rows = rows.at[im.batch, span].set(vision.image_span(params, im.inputs, cfg, num))
    return rows, jnp.asarray(mask)


def prepare(params: dict, cfg: ModelConfig, token_ids, hasher=None, image_mask=None):
    """Host side of a forward: validate ids, hash the n-grams (with `hasher`, default `hasher_for(params)`; image
    tokens take part in no n-gram) and fetch Engram rows."""
    ids = check_tokens(token_ids, cfg)
    core, tables = strip_tables(params)
    rows = []
    if cfg.engram_layer_ids:
        if hasher is None:
            hasher = hasher_for(params, cfg)
        dead = None if image_mask is None else np.asarray(image_mask)
        rows = engram_rows(tables, hasher.hash_ids(ids, dead_mask=dead))
    return core, ids, rows


def forward(params: dict, cfg: ModelConfig, token_ids, numerics: Numerics = quant.REFERENCE, hasher=None,
            ops: Ops = XLA, images=None) -> jax.Array:
    """token_ids int32 [batch, seq] -> float32 logits [batch, seq, vocab]: the exact full-sequence path.

    `numerics` picks the reference's rounding points (default: all of them, bf16 activations);
    `quant.EXACT_F32` turns them off. `hasher` maps ids to Engram rows (default `hasher_for(params)`: the
    checkpoint's tokenizer for a loaded checkpoint, the built-in one for presets). `ops`: which code
    runs the linears, MoE and mHC sites (`dsv41.ops`; default the plain XLA composition). `images`:
    `ImagePlacement`s; their spans take the tower's embeddings, route with `bias_vl` and skip the Engram.
    Layers of one kind run as one scanned body (`layer_runs`): a per-layer tree is stacked by run on each call (a
    copy of the weights); give `layer_runs.stack_params(params, cfg)` for repeated calls on large weights.
    """
    return forward_with_trace(params, cfg, token_ids, numerics, hasher, ops, images, with_trace=False)


def forward_with_trace(params: dict, cfg: ModelConfig, token_ids, numerics: Numerics = quant.REFERENCE,
                       hasher=None, ops: Ops = XLA, images=None, with_trace: bool = True):
    """forward() plus named intermediates (per layer: block_in/out, attn_out, ffn_out, hc coefficients, MoE
    routing, compressor latents, index scores, top-k, candidates; engram outputs)."""
    ids = check_tokens(token_ids, cfg)
    embeds, mask = image_rows(params, cfg, ids, images, numerics)
    core, ids, rows = prepare(params, cfg, ids, hasher, mask)
    core = {k: v for k, v in core.items() if k not in VISION_KEYS}  # the text program never reads them
    core = layer_runs.stack_params(core, cfg)
    return _forward(core, jnp.asarray(ids), rows, cfg, numerics, with_trace=with_trace, ops=ops,
                    image_embeds=embeds, image_mask=mask)

