"""The jitted programs of the engine. Each takes (params, pool, batch) and returns the new pool (donated).

- `run_full`: all layers on a chunk of tokens (exact prefill chunks, and decode with one token a row where the
  engine does not split it).
- `run_decode_first`, `run_decode_rest`: a decode step in two programs cut at the split layer (the embedding and
  layers [0, split), then the rest and the head), which compile side by side and each in about 2/3 of the one
  program's time (`EngineConfig.split_decode`).
- `run_encoder`: layers [0, split) plus the split layer's KV writes (SWA, compressed KV, index keys) for every
  token of the chunk; returns the split layer's input stream for the chunk's last `replay_tokens` rows.
- `run_decoder`: the rest of the split layer and the layers after it on each request's last `replay_tokens`
  prompt tokens (SWA bounded replay: their windows start at N - replay_tokens).
- `run_spec`: a speculative decode step, DSpark's drafts verified and the next block drafted; `run_spec_rest`:
  the same from the split layer on, after `run_decode_first` on its chunk (`EngineConfig.split_decode` True).
- `sample`: the tokens of a step in which some row draws (top-k / top-p sampling), its branches chosen on the
  host; the other programs return their logits and argmax.
The layer math is dsv41's; what is new here is reading/writing the pool.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp

from dsv41 import attention as A
from dsv41 import compressor, dspark, engram, indexer, mhc, model, ngram_hash, quant, sharding
from dsv41 import kv_layout as kl
from dsv41.config import ModelConfig
from dsv41.kv_layout import LayerKV
from dsv41 import layer_runs
from dsv41.layer_plan import Carry, LayerPlan
from dsv41.layer_runs import Run
from dsv41.nn import rms_norm
from dsv41.quant import Numerics
from dsv41.rope import cos_sin
from serving.engine.backends import Backends, KernelOptions
from serving.engine import executables, host_rows, spec_sampling
from serving.engine import kv_pool
from serving.engine.kv_pool import KVPool

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """A padded batch of B rows x T tokens. Padding rows have slot == num_slots and n_valid == 0. On a mesh the
    rows of data rank d are [d * B / ranks, (d + 1) * B / ranks), their slots and pages rank-local."""

    tokens: jax.Array  # int32 [B, T]
    pos0: jax.Array  # int32 [B]: position of tokens[:, 0]
    n_valid: jax.Array  # int32 [B]: real tokens in the row
    slot: jax.Array  # int32 [B]: sequence slot in the pool
    block_table: jax.Array  # int32 [B, ctx_pages]: the sequence's pages (num_pages where unused)
    write_lo: jax.Array  # int32 [B]: global KV is written only for positions >= write_lo (prefix replay)
    ring_lo: jax.Array  # int32 [B, L]: the first position each layer's ring may serve (bounded replay clips there)
    rows: list  # per Engram layer: quant.Fp8Rows [B, T, n_cols, d] (dequantized in the program)
    # steps that hold image tokens (None otherwise, so text steps keep their programs): the image spans' rows
    # in place of their embeddings (prefill chunks) and where the spans are (bias_vl routing, no Engram)
    image_embeds: jax.Array | None = None  # [B, T, D]
    image_mask: jax.Array | None = None  # bool [B, T]
    # a decode step's tokens (a speculative step's chunks) fed on the device (`EngineConfig.device_feed`)
    feed: "Feed | SpecFeed | None" = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Feed:
    """A decode batch's tokens (T = 1) where the host has not read them yet: row i's token is
    concat(prev, first)[index[i]] (the previous decode step's sampled ids, then the previous prefill call's first
    tokens; `DeviceEngram`'s rows hashed from it in the program) where index[i] >= 0, else the host's tokens[i]. On
    a mesh every field is per data rank: prev and first hold each rank's rows padded to the top decode bucket and
    to a prefill call's rows a rank, index is rank-local."""

    prev: jax.Array  # int32 [ranks * top bucket]
    first: jax.Array  # int32 [ranks * prefill rows]
    index: jax.Array  # int32 [B]
    history: jax.Array  # int32 [B, max_ngram - 1]: the classes before each row's token (`ngram_hash.hash_step`'s)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecFeed:
    """A speculative decode batch's chunks where the host has not read the step before (`EngineConfig.device_feed`
    with DSpark). Row i with index[i] >= 0 continues row index[i] of the previous speculative step, whose anchor
    sat at the host's pos0[i] (its token: tokens[i, 0]): with m its accepted drafts, the new anchor is that step's
    bonus at a = pos0 + m + 1, followed by the drafts it drew (n_next of them verified), and where a chunk would
    start at an odd position (`Speculative.spec_rerun`: rerun) by the token before a (the last accepted draft, or
    the old anchor). Row i with first_index[i] >= 0 takes its anchor, in column first_col[i], from the previous
    prefill call's first tokens (its positions are the host's). Other rows are the host's. Every row's Engram rows
    are hashed in the program (history: the classes before the host's pos0). On a mesh every field is per data
    rank, as `Feed`'s: the previous step's arrays padded to the top decode bucket a rank."""

    out: jax.Array  # int32 [ranks * top bucket, k + 1]: the previous step's accepted drafts, then its bonus
    accepted: jax.Array  # int32 [ranks * top bucket]
    drafts: jax.Array  # int32 [ranks * top bucket, k]: the blocks it drafted
    n_next: jax.Array  # int32 [ranks * top bucket]: the drafts of each that the next step verifies
    first: jax.Array  # int32 [ranks * prefill rows]
    index: jax.Array  # int32 [B]
    first_index: jax.Array  # int32 [B]
    first_col: jax.Array  # int32 [B]
    history: jax.Array  # int32 [B, max_ngram - 1]
    rerun: bool = dataclasses.field(default=False, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceEngram:
    """The Engram tables in device memory and the hasher's arrays (`ngram_hash.device_constants`), in the params
    tree under `DEVICE_ENGRAM` with `EngineConfig.device_feed`. ranks > 1: each table's rows split over the mesh's
    data ranks (padded to a multiple of them; Flash's 197 GB do not fit one GPU), each rank gathering the rows it
    holds for every rank's tokens."""

    tables: list  # quant.Fp8Rows [rows, d] per Engram layer (a rank's block of rows where ranks > 1)
    hash: dict
    ranks: int = dataclasses.field(default=1, metadata=dict(static=True))


DEVICE_ENGRAM = "device_engram"


def _split_gather(table: quant.Fp8Rows, ids: jax.Array) -> quant.Fp8Rows:
    """Rows ids [b, ...] (global row ids, this rank's tokens) of a table whose rows are split over the data ranks
    (this rank's block [R / ranks, d]), inside the per-rank program: every rank's ids gathered, each rank reads the
    ones in its block (zeros elsewhere), and a reduce-scatter over the ranks sums each token's one nonzero
    contribution back to its rank (exact: a sum of zeros and one value)."""
    n = table.weight.shape[0]
    every = jax.lax.all_gather(ids, sharding.DATA, axis=0, tiled=True)  # [ranks * b, ...]
    local = every - jax.lax.axis_index(sharding.DATA) * n
    mine = (local >= 0) & (local < n)
    got = engram.gather_rows(table, jnp.where(mine, local, 0))

    def back(a):  # [ranks * b, ..., d] -> [b, ..., d], as bytes
        u = a if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, jnp.uint8)
        u = jax.lax.psum_scatter(jnp.where(mine[..., None], u, 0), sharding.DATA, scatter_dimension=0, tiled=True)
        return u if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(u, a.dtype)

    return quant.Fp8Rows(back(got.weight), back(got.scale))


def _fed(params, b: Batch, cfg: ModelConfig) -> Batch:
    """b with a `Feed`'s or `SpecFeed`'s tokens (and positions) in place and their Engram rows gathered (the batch
    as the host would have built it had it read the tokens)."""
    f = b.feed
    if f is None:
        return b
    if isinstance(f, SpecFeed):
        return _spec_fed(params, b, cfg)[0]
    src = jnp.concatenate([f.prev, f.first])
    tok = jnp.where(f.index >= 0, src[jnp.maximum(f.index, 0)], b.tokens[:, 0])[:, None]
    return dataclasses.replace(b, tokens=tok, rows=_device_engram_rows(params, tok, f.history, cfg), feed=None)


def _device_engram_rows(params, tok: jax.Array, history: jax.Array, cfg: ModelConfig) -> list:
    """The Engram rows [B, T, n_cols, d] per Engram layer of tok [B, T] after history [B, H] (classes), hashed and
    gathered from the tables in device memory (`DeviceEngram`)."""
    if not cfg.engram_layer_ids:
        return []
    dev: DeviceEngram = params[DEVICE_ENGRAM]
    ids = ngram_hash.device_rows(dev.hash, tok, history)
    gather = engram.gather_rows if dev.ranks == 1 else _split_gather
    return [gather(t, ids[:, :, i]) for i, t in enumerate(dev.tables)]


def _spec_fed(params, b: Batch, cfg: ModelConfig, n_verify: jax.Array | None = None, engram_rows: bool = True
              ) -> tuple[Batch, jax.Array]:
    """b's `SpecFeed` resolved: each continuing row's chunk, pos0 and n_valid from the previous step's outputs, the
    prefill's first tokens in their columns, and (engram_rows) every row's Engram rows. n_verify [B]: the host's
    (None where only the batch is needed). -> (the batch as the host would have built it, n_verify with the
    continuing rows' from the previous step)."""
    f: SpecFeed = b.feed
    B, T = b.tokens.shape
    k = f.drafts.shape[1]
    cont = f.index >= 0
    j = jnp.maximum(f.index, 0)
    m, out, drafts, nv = f.accepted[j], f.out[j], f.drafts[j], f.n_next[j]  # [B], [B, k + 1], [B, k], [B]
    a = b.pos0 + m + 1  # the new anchor's position
    back = (a % 2) if f.rerun else jnp.zeros_like(a)
    bonus = jnp.take_along_axis(out, m[:, None], axis=1)[:, 0]
    before = jnp.where(m > 0, jnp.take_along_axis(out, jnp.maximum(m - 1, 0)[:, None], axis=1)[:, 0],
                       b.tokens[:, 0])
    col = jnp.arange(T, dtype=jnp.int32)[None]
    d = col - back[:, None] - 1  # the draft in each column
    chunk = jnp.where(col < back[:, None], before[:, None],
                      jnp.where(col == back[:, None], bonus[:, None],
                                jnp.where((d >= 0) & (d < nv[:, None]),
                                          jnp.take_along_axis(drafts, jnp.clip(d, 0, k - 1), axis=1), 0)))
    firsts = f.first[jnp.maximum(f.first_index, 0)]
    host = jnp.where((f.first_index >= 0)[:, None] & (col == f.first_col[:, None]), firsts[:, None], b.tokens)
    tokens = jnp.where(cont[:, None], chunk, host).astype(jnp.int32)
    pos0 = jnp.where(cont, a - back, b.pos0)
    n_valid = jnp.where(cont, nv + 1 + back, b.n_valid)
    rows = []
    if cfg.engram_layer_ids and engram_rows:
        # the classes of positions pos0 - H .. pos0 + k (the host's pos0): its history, the old anchor, the drafts
        # accepted after it; a continuing row's history starts pos0' - pos0 = m + 1 - back positions in
        H = f.history.shape[1]
        cls = params[DEVICE_ENGRAM].hash["token_map"][jnp.concatenate([b.tokens[:, :1], out[:, :k]], axis=1)]
        ext = jnp.concatenate([f.history, cls.astype(jnp.int32)], axis=1)  # [B, H + k + 1]
        shift = jnp.where(cont, pos0 - b.pos0, 0)
        hist = jnp.take_along_axis(ext, shift[:, None] + jnp.arange(H, dtype=jnp.int32)[None], axis=1)
        rows = _device_engram_rows(params, tokens, hist, cfg)
    n_verify = nv if n_verify is None else jnp.where(cont, nv, n_verify)
    return dataclasses.replace(b, tokens=tokens, pos0=pos0, n_valid=n_valid, rows=rows, feed=None), n_verify


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: jax.Array  # float32 [B]; 0 = greedy
    top_p: jax.Array  # float32 [B]
    top_k: jax.Array  # int32 [B]; 0 = off
    key: jax.Array  # uint32 [B, 2]: per-request key folded with the step


def _dequant_fp8_rows(q, s):
    return quant.fp8_dequantize(q, quant.ue8m0_decode(s))


def _gather_kv(pages: LayerKV, block_table, idx):
    """A KV source's compressed main-KV entries idx [B, S, K] (-1 = none) -> dequantized [B, S, K, Dh],
    valid [B, S, K]."""
    g = jnp.maximum(idx, 0)
    packed = kl.read_entries(pages.kv_packed, block_table, g)
    scale = kl.read_entries(pages.kv_scale, block_table, g)
    return quant.fp4_dequantize(packed, scale.astype(jnp.float32), 16), idx >= 0


def _context_index_keys(pages: LayerKV, block_table, cfg):
    """Every index key of the pages block_table [B, C] names (a KV source's) -> [B, C * E, ID] (dequantized)."""
    bt = block_table
    packed = pages.ik_packed.at[bt].get(mode="fill", fill_value=0)
    scale = pages.ik_scale.at[bt].get(mode="fill", fill_value=0)
    k = quant.fp4_dequantize(packed, quant.ue8m0_decode(scale), 32)
    return k.reshape(bt.shape[0], -1, cfg.index_head_dim)


# The XLA indexer scores the context in blocks of about this many entries (at least twice the top-k, so that a
# merge sorts at most 1.5x the block), only as many blocks as the batch's furthest visible entry reaches (a loop
# with a run-time trip count): its work follows the context, not the block table's width (max_model_len). Small
# blocks waste little on a short prompt (the first block is scored whole) and cost little in merges on a long one
# (docs/PERFORMANCE.md section 9). A decode step's rows (one query each) score little per block, and each loop
# iteration costs XLA's GPU backend a round trip to the host for its condition: there, blocks of 2048 (what the
# XLA path's GPU decode was timed with).
SCORE_BLOCK_ENTRIES = 256
DECODE_SCORE_BLOCK_ENTRIES = 2048


def _score_blocks(qi, wi, pages: LayerKV, block_table, pos, r: int, cfg, num: Numerics, min_entries: int,
                  multiple: int):
    """The context's index-key scores by blocks of pages (block_table [B, C]): -> (block(i) -> float32 [B, T, W]
    scores of entries [i * W, (i + 1) * W), -inf where not visible; W; the block count; the blocks some query
    sees, at least 1 (traced)). W: `indexer.block_pages` of SCORE_BLOCK_ENTRIES (a decode step's:
    DECODE_SCORE_BLOCK_ENTRIES). Each score is `indexer.raw_scores`' arithmetic on its own key, as in one pass."""
    C = block_table.shape[1]
    E = pages.ik_packed.shape[1]
    entries = SCORE_BLOCK_ENTRIES if pos.shape[1] > 1 else DECODE_SCORE_BLOCK_ENTRIES
    bp = indexer.block_pages(C, E, entries, min_entries, multiple)
    nblk, W = -(-C // bp), bp * E
    bt = jnp.pad(block_table, ((0, 0), (0, nblk * bp - C)), constant_values=pages.ik_packed.shape[0])
    nvis = (pos + 1) // r  # [B, T]: entries each query sees

    def block(i):
        keys = _context_index_keys(pages, jax.lax.dynamic_slice_in_dim(bt, i * bp, bp, axis=1), cfg)
        s = indexer.raw_scores(qi, wi, keys, num.jdtype)
        return jnp.where(i * W + jnp.arange(W)[None, None] < nvis[..., None], s, -jnp.inf)

    return block, W, nblk, jnp.clip((jnp.max(nvis) + W - 1) // W, 1, nblk)


def _context_select(qi, wi, pages: LayerKV, block_table, pos, r: int, cfg, num: Numerics, cand_blocks=None,
                    want_candidates: bool = False):
    """One XLA indexer layer over the rows' pages (block_table [B, C]) without the [B, T, C * E] scores: the
    blocks some query sees scored one after another, each merged into the running top k (`indexer.running_topk`).
    qi [B, T, IH, ID], wi [B, T, IH] at pos [B, T]; cand_blocks int32 [B, T, NB] (the candidate source's block
    ids, -1 = none): only their entries compete. -> (`indexer.select_topk`'s entry ids int32 [B, T, min(index_topk,
    C * E)]; with want_candidates, `indexer.candidate_mask`'s blocks as ids (`indexer.candidate_blocks`), else
    None)."""
    G = block_table.shape[1] * pages.ik_packed.shape[1]
    k = min(cfg.index_topk, G)
    bs = cfg.candidate_block_size
    mult = bs if (want_candidates or cand_blocks is not None) else 1
    block, W, nblk, live = _score_blocks(qi, wi, pages, block_table, pos, r, cfg, num, 2 * k, mult)
    listed = None if cand_blocks is None else indexer.block_mask(cand_blocks, nblk * W // bs)  # bool [B, T, blocks]

    def candidates_only(i):
        keep = jnp.repeat(jax.lax.dynamic_slice_in_dim(listed, i * (W // bs), W // bs, axis=2), bs, axis=2)
        return jnp.where(keep, block(i), -jnp.inf)

    ids, maxima = indexer.running_topk(block if listed is None else candidates_only, nblk, live, k,
                                       block_size=bs if want_candidates else 0)
    cand = indexer.candidate_blocks(maxima, pos, r, cfg) if want_candidates else None
    return indexer.visible_ids(ids, pos, r), cand


def _compress_chunk(x, p, r, cfg, num, lkv: LayerKV, b: Batch):
    """Latents of the groups the chunk reaches (`kv_layout.compress_step`) on a KV source (its record lkv).
    -> latent [B, G, Dh], abs group ids [B, G], complete [B, G], the new pending state [S, 2 * Dh] (ratio 1:
    None)."""
    kv, score = compressor.project(x, p, r, num)
    state = kl.read_slots(lkv.comp_state, b.slot) if r == 2 else None
    lat, g, complete, new_state = kl.compress_step(kv, score, state, b.pos0, b.n_valid, p, r, cfg, num.jdtype)
    return lat, g, complete, kl.write_slots(lkv.comp_state, b.slot, new_state) if r == 2 else None


def _pages(pool: KVPool, plan: LayerPlan, cfg: ModelConfig) -> LayerKV:
    """The record of the KV source whose pages the layer reads. SWA-only layers select no entry, but the
    attention kernel takes pages all the same: the first source's."""
    return pool.of_layer(cfg, cfg.kv_source_layers[0] if plan.swa_only else plan.kv_source)


def _decode_with_kernels(x, p, run: Run, layer, cfg: ModelConfig, num: Numerics, pool: KVPool, rec: LayerKV, b: Batch,
                         carry: Carry, freqs, backend: str, opts: KernelOptions, ops):
    """Decode (one token a row, phase 'full') through the fused kernels: the token's KV writes (ring, and on
    KV-source layers the compressed entry, index key and pending state) in one kernel, the indexer's scores and
    top-k straight from the MXFP4 pool (candidate entries only after the candidate source layer), and the sparse
    attention over the FP8 ring and the selected FP4 entries. Arguments as `run_attention`'s.
    -> (output [B, 1, D], the run's record, carry).
    backend: 'pallas' (Mosaic GPU), 'interpret' (the kernels in the interpreter) or 'reference' (their jnp
    references on the kernels' inputs: checks this wiring, not the kernels)."""
    from pallas_kernels import kv_write as kvw

    kb = "xla" if backend == "reference" else backend
    plan, r = run.plan, run.plan.ratio
    pos = b.pos0[:, None]
    ratio = r if plan.writes_kv else 0  # other layers only write their ring

    with jax.named_scope("kv_write"):  # (sub-scopes of "attention" for scripts/profile_step.py)
        kv = A.window_kv(x, p, pos, freqs, cfg, num, ops=ops)
        # the layer's rings, and on a KV source its pages and state
        lkv, ring_slot = kv_pool.ring_view(rec, b.slot, layer - run.first)
        extra = {}
        if ratio:
            ck, cs = compressor.project(x, p["compressor"], ratio, num)
            # the indexer's query weights are split over tensor ranks and unread here (index keys: wk, k_norm)
            p_idx = {k: v for k, v in p["indexer"].items() if k not in ("wq_b", "weights_proj")}
            extra = dict(comp_kv=ck[:, 0], comp_score=None if cs is None else cs[:, 0], p_comp=p["compressor"],
                         p_idx=p_idx, freqs=freqs)
        # (a KV source is a run of one: its ring ids are its slots, which its compressor state takes too)
        ring = _per_rank(kvw.kv_write_decode)(lkv, kv[:, 0], ring_slot, b.pos0, b.n_valid, b.block_table,
                                              b.write_lo, kcfg=kvw.KVWriteConfig(ratio, cfg.norm_eps), num=num,
                                              backend=kb, **extra)
    pages = ring if plan.writes_kv else _pages(pool, plan, cfg)

    fuse = opts.fuse_rope
    with jax.named_scope("q_proj"):
        q, qr = A.project_q(x, p, pos, freqs, cfg, num, rope=not fuse, ops=ops)
    if plan.runs_indexer:
        with jax.named_scope("indexer"):
            qi, wi = indexer.index_queries(x, qr, p["indexer"], pos, freqs, cfg, num, ops=ops)
            carry = _kernel_index_topk(qi, wi, pages, b, pos, r, plan, carry, cfg, num, backend, opts)

    R = ring.swa_q.shape[1]  # ring_size(cfg, layer, the engine's swa_replay_tokens)
    lo = b.ring_lo[:, layer]
    win_pos = kl.ring_positions(b.pos0 + b.n_valid, R, lo)
    valid = (win_pos <= b.pos0[:, None]) & (win_pos > b.pos0[:, None] - cfg.window_size)
    valid &= (b.slot < rec.swa_q.shape[0])[:, None]  # padding rows: slot == num_slots, no ring
    # the window's rows straight in the pool's ring buffer (no per-row copy of the rings)
    swa_rows = jnp.where(valid, ring_slot[:, None] * R + jnp.arange(R, dtype=jnp.int32)[None], -1)
    topk = jnp.full((x.shape[0], 64), -1, jnp.int32) if plan.swa_only else carry.topk[:, 0]
    kw = {"backend": "xla", "out_dtype": q.dtype} if backend == "reference" else {"backend": backend}
    with jax.named_scope("attend"):
        o = _attention_heads(q[:, 0], ring.swa_q.reshape(-1, cfg.head_dim), ring.swa_s.reshape(-1, cfg.head_dim // 32),
                             topk, b.block_table, pages.kv_packed, pages.kv_scale, p["attn_sink"], swa_rows=swa_rows,
                             **kw, **_rope_kw(b.pos0, freqs, fuse))
    with jax.named_scope("output"):
        y = A.output(o[:, None], pos, p, freqs, cfg, num, rope=not fuse, ops=ops)
    return y, kv_pool.fold_view(ring, run.n), carry


def _per_rank(kernel_op):
    """A kernel op of the KV path on replicated inputs (the pool, the KV latent and the index keys are whole on
    every tensor rank): in a tensor-parallel program every rank runs it whole (`sharding.TensorReplicated`; XLA
    cannot partition a kernel). The indexer stays replicated too: its queries' heads are split by the weights,
    but gathering them (B x heads x 128 values a query) costs less than summing every rank's per-entry scores
    before the top-k (B x entries float32 a query), every rank reads every index key either way, and each rank
    then picks the same entries."""
    return sharding.TensorReplicated(kernel_op) if sharding.tensor_auto() else kernel_op


def _attention_heads(q, keys_q, keys_s, topk, page_table, kv_packed, kv_scale, sink, **kw):
    """`sparse_attention.sparse_attention` (q [N, H, Dh], sink [H] -> [N, H, Dh]); in a tensor-parallel program
    each tensor rank runs the kernel on its heads (split as wq_b splits them) against the whole window and pool
    (replicated), no collective."""
    from pallas_kernels import sparse_attention as sa

    arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kw.items() if k not in arrays}

    def attend(q, sink, keys_q, keys_s, topk, page_table, kv_packed, kv_scale, arrays):
        return sa.sparse_attention(q, keys_q, keys_s, None, topk, page_table, kv_packed, kv_scale, sink, **arrays,
                                   **static)

    args = (q, sink, keys_q, keys_s, topk, page_table, kv_packed, kv_scale, arrays)
    if not sharding.tensor_auto():
        return attend(*args)
    heads = sharding.split_spec(3, 1)
    rep = jax.sharding.PartitionSpec()
    return sharding.per_tensor_rank(attend, in_specs=(heads, sharding.split_spec(1, 0)) + (rep,) * 7,
                                    out_specs=heads)(*args)


def _window_rows(pos, ring_pos, R: int, chunk_start, T: int, W: int):
    """Rows of each query's window keys, positions (pos - W, pos], in the flat FP8 buffer [ring rows (B*R) |
    chunk rows (B*T)]: a ring slot serves a position only if it holds it (ring_pos, NO_POS below ring_lo);
    positions >= chunk_start are the chunk's own keys (chunk_start None: every key is in the ring).
    pos [B, T], ring_pos [B, R] -> int32 [B, T, W], -1 where none."""
    B = pos.shape[0]
    kp = pos[:, :, None] - jnp.arange(W, dtype=jnp.int32)[None, None, :]
    bi = jnp.arange(B, dtype=jnp.int32)[:, None, None]
    slot = jnp.mod(kp, R)
    held = jnp.take_along_axis(ring_pos, slot.reshape(B, -1), axis=1).reshape(kp.shape)
    rows = jnp.where((kp >= 0) & (held == kp), bi * R + slot, -1)
    if chunk_start is not None:
        off = kp - chunk_start[:, None, None]
        rows = jnp.where(off >= 0, B * R + bi * T + off, rows)
    return rows.astype(jnp.int32)


def _rope_kw(pos, freqs, fuse: bool) -> dict:
    """The attention kernel's arguments that rotate q and its output at positions pos [N] (fuse), else none."""
    if not fuse:
        return {}
    from pallas_kernels import sparse_attention as sa

    cos, sin = cos_sin(pos, freqs)  # the angles A.project_q / A.output rotate by
    return dict(rope_cos=cos, rope_sin=sin, rope_query=True, rope_output=True,
                config=sa.KernelConfig(fuse_rope=True))


def _kernel_index_topk(qi, wi, pages: LayerKV, b: Batch, pos, r: int, plan: LayerPlan, carry: Carry, cfg,
                       num: Numerics, backend: str, opts: KernelOptions) -> Carry:
    """One indexer layer through the scoring kernel, straight from the MXFP4 pool (decode, and prefill chunks
    with KernelOptions.prefill_indexer_kernel): the encoder indexers and the candidate source layer score every
    visible entry (a chunk's queries in groups that share one pass over the entries), the layers after it only
    their candidates. qi [B, T, IH, ID], wi [B, T, IH], pos [B, T] -> the carry with the top-k entry ids
    int32 [B, T, k] and, from the candidate source, the candidate block ids."""
    from pallas_kernels import indexer_logits as il

    ikp, iks = pages.ik_packed, pages.ik_scale
    # the reference backend (the kernels' jnp references, CPU tests) selects by XLA's radix select, the
    # threshold kernel's reference (same positions)
    method = "radix" if backend == "reference" and opts.indexer_topk == "kernel" else opts.indexer_topk
    icfg = dataclasses.replace(il.IndexerConfig.from_model(cfg), topk_method=method)
    kw = dict(cfg=icfg, backend="xla" if backend == "reference" else backend, dtype=num.jdtype)
    if plan.uses_candidates:
        topk, _ = _per_rank(il.index_topk)(qi, wi, ikp, iks, b.block_table, pos, r, cand_blocks=carry.cand_blocks,
                                           **kw)
        return dataclasses.replace(carry, topk=topk)
    want = plan.makes_candidates
    entries = b.block_table.shape[1] * ikp.shape[1]
    blocks = opts.prefill_indexer_block_entries
    # a chunk of at most `query_group` queries (a decode step, DSpark's verify chunk) goes to the decode kernel,
    # whose work follows the context: it scores the whole table in one pass, as a decode step does. By blocks,
    # their loop (a run-time trip count) and the candidate blocks' every-seen branch would each cost XLA's GPU
    # backend a round trip to the host (`host_round_trips`): a fed step's dispatch could not return before the
    # device reached them
    if pos.shape[1] > il.query_group(qi.shape[2]) and 0 < blocks < entries:  # a prefill chunk: the blocks it sees
        select = functools.partial(il.context_topk_blocks, block_entries=blocks)
    else:
        select = functools.partial(il.index_topk, num_entries=entries)
    topk, cand = _per_rank(select)(qi, wi, ikp, iks, b.block_table, pos, r, want_candidates=want, **kw)
    return dataclasses.replace(carry, topk=topk, **({"cand_blocks": cand} if want else {}))


def _prefill_attention_kernel(q, keys_q, keys_s, rows, pages: LayerKV, b: Batch, topk, sink, backend: str,
                              rope: dict):
    """Many queries a row through the fused sparse-attention kernel, one kernel row per query token: its window
    rows in the flat FP8 key buffer (keys_q [N, Dh], keys_s [N, Dh/32]) plus its own top-k entries (topk
    [B, T, K]; None on SWA-only layers).
    q [B, T, H, Dh] -> [B, T, H, Dh]. rope: `_rope_kw` of the B * T query positions."""
    B, T, H, Dh = q.shape
    topk = jnp.full((B * T, 64), -1, jnp.int32) if topk is None else topk.reshape(B * T, -1)
    kw = {"backend": "xla", "out_dtype": q.dtype} if backend == "reference" else {"backend": backend}
    o = _attention_heads(q.reshape(B * T, H, Dh), keys_q, keys_s, topk, jnp.repeat(b.block_table, T, axis=0),
                         pages.kv_packed, pages.kv_scale, sink, swa_rows=rows.reshape(B * T, -1), **kw, **rope)
    return o.reshape(B, T, H, Dh)


def cached_attention(x, lp, layer: int, cfg: ModelConfig, num: Numerics, pool: KVPool, b: Batch, carry: Carry,
                     freqs, phase: str, backends: Backends = Backends()):
    """`run_attention` of one layer on the whole pool (outside the programs' scans: tests, tools).
    -> (output [B, T, D] or None, pool, carry)."""
    r, _ = layer_runs.run_of(cfg, layer)
    y, rec, carry = run_attention(x, lp, layer_runs.runs(cfg)[r], layer, cfg, num, pool, pool.runs[r], b, carry,
                                  freqs, phase, backends)
    return y, pool.with_run(r, rec), carry


def run_attention(x, lp, run: Run, layer, cfg: ModelConfig, num: Numerics, pool: KVPool, rec: LayerKV, b: Batch,
                  carry: Carry, freqs, phase: str, backends: Backends = Backends()):
    """One layer's attention against the pool. run: its run of layers (`layer_runs.Run`: the static plan), layer:
    the layer (an int, or traced inside a run's scan); rec: the run's record (`KVPool.runs`), written here; pool:
    the rest, read (the KV source's pages). phase: 'full' (read + write), 'kv_only' (writes only, for the split
    layer in the encoder program), 'attn_only' (reads only; the KV of these tokens is already written).
    backends: the attention backend (decode: the fused kernels unless 'xla'), its options, the linears' ops.
    carry: what earlier layers handed on (the latest top-k, the candidates). -> (output [B, T, D] or None, the
    run's record, carry)."""
    p = lp
    backend, opts, ops = backends.attention, backends.options, backends.ops
    B, T, _ = x.shape
    if backend != "xla" and T == 1 and phase == "full":
        return _decode_with_kernels(x, p, run, layer, cfg, num, pool, rec, b, carry, freqs, backend, opts, ops)
    fuse = opts.fuse_rope and backend != "xla"
    plan, r = run.plan, run.plan.ratio
    pos = b.pos0[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    tok_ok = jnp.arange(T)[None] < b.n_valid[:, None]
    lo = b.ring_lo[:, layer]
    source = rec  # a KV source (a run of one): its own pages and state, read at its slots
    rec, ring_slot = kv_pool.ring_view(rec, b.slot, layer - run.first)
    R = rec.swa_q.shape[1]  # ring_size(cfg, layer, the engine's swa_replay_tokens)
    rq = kl.read_slots(rec.swa_q, ring_slot)
    rs = kl.read_slots(rec.swa_s, ring_slot)
    Dh = cfg.head_dim
    if phase == "attn_only":
        win_k = _dequant_fp8_rows(rq, rs)
        win_pos = kl.ring_positions(b.pos0 + b.n_valid, R, lo)
        # the kernel's flat window buffer: the ring, which already holds this chunk
        keys_q, keys_s = rq.reshape(B * R, Dh), rs.reshape(B * R, -1)
        ring_pos, chunk_start = win_pos, None
    else:
        kv = A.window_kv(x, p, pos, freqs, cfg, num, ops=ops)
        kq, ks = quant.fp8_quantize(kv)
        ks = quant.ue8m0_encode(ks)
        new_rq = kl.write_ring(rq, kq, b.pos0, b.n_valid)
        new_rs = kl.write_ring(rs, ks, b.pos0, b.n_valid)
        rec = dataclasses.replace(rec, swa_q=kl.write_slots(rec.swa_q, ring_slot, new_rq),
                                  swa_s=kl.write_slots(rec.swa_s, ring_slot, new_rs))
        win_k = jnp.concatenate([_dequant_fp8_rows(rq, rs), kv.astype(jnp.float32)], 1)
        win_pos = jnp.concatenate([kl.ring_positions(b.pos0, R, lo), jnp.where(tok_ok, pos, A.NO_POS)], 1)
        # the kernel's flat window buffer: the ring as it was before this chunk, then the chunk's keys (FP8; with
        # the serving numerics the keys are FP8 values already, so this rounding changes nothing)
        keys_q = jnp.concatenate([rq.reshape(B * R, Dh), kq.astype(rq.dtype).reshape(B * T, Dh)])
        keys_s = jnp.concatenate([rs.reshape(B * R, -1), ks.astype(rs.dtype).reshape(B * T, -1)])
        ring_pos, chunk_start = kl.ring_positions(b.pos0, R, lo), b.pos0

    if plan.writes_kv and phase != "attn_only":  # a KV source: its own record holds its pages
        lat, g, complete, new_state = _compress_chunk(x, p["compressor"], r, cfg, num, source, b)
        gpos = g * r
        ik = indexer.index_keys(lat, p["indexer"], gpos, freqs, cfg, num)
        ce = A.compressed_entries(lat, gpos, freqs, num)
        ok = complete & (gpos >= b.write_lo[:, None])
        ikp, iks = quant.fp4_quantize(ik, 32, e4m3_scales=False)
        cep, ces = quant.fp4_quantize(ce, 16, e4m3_scales=True)
        bt = b.block_table
        rec = dataclasses.replace(
            rec, kv_packed=kl.write_entries(rec.kv_packed, bt, g, ok, cep),
            kv_scale=kl.write_entries(rec.kv_scale, bt, g, ok, quant.e4m3(ces)),
            ik_packed=kl.write_entries(rec.ik_packed, bt, g, ok, ikp),
            ik_scale=kl.write_entries(rec.ik_scale, bt, g, ok, quant.ue8m0_encode(iks)), comp_state=new_state)
    pages = rec if plan.writes_kv else _pages(pool, plan, cfg)
    rec = kv_pool.fold_view(rec, run.n)
    if phase == "kv_only":
        return None, rec, carry
    if plan.runs_indexer:
        q, qr = A.project_q(x, p, pos, freqs, cfg, num, rope=not fuse, ops=ops)
        qi, wi = indexer.index_queries(x, qr, p["indexer"], pos, freqs, cfg, num, ops=ops)
        if backend != "xla" and opts.prefill_indexer_kernel:
            carry = _kernel_index_topk(qi, wi, pages, b, pos, r, plan, carry, cfg, num, backend, opts)
        else:
            topk, cand = _context_select(qi, wi, pages, b.block_table, pos, r, cfg, num,
                                         carry.cand_blocks if plan.uses_candidates else None, plan.makes_candidates)
            carry = dataclasses.replace(carry, topk=topk, **({"cand_blocks": cand} if plan.makes_candidates else {}))
    else:
        q, _ = A.project_q(x, p, pos, freqs, cfg, num, rope=not fuse, ops=ops)
    comp_k = comp_valid = None
    if not plan.swa_only:
        comp_k, comp_valid = _gather_kv(pages, b.block_table, carry.topk)
    if backend != "xla":
        rows = _window_rows(pos, ring_pos, R, chunk_start, T, cfg.window_size)
        o = _prefill_attention_kernel(q, keys_q, keys_s, rows, pages, b, None if plan.swa_only else carry.topk,
                                      p["attn_sink"], backend, _rope_kw(pos.reshape(-1), freqs, fuse))
    else:
        o = A.attend(q, pos, win_k, win_pos, comp_k, comp_valid, p["attn_sink"], cfg, num)
    return A.output(o, pos, p, freqs, cfg, num, rope=not fuse, ops=ops), rec, carry


def _layers(params, pool, b: Batch, h, pre, cfg, num, first: int, last: int, phases: dict,
            backends: Backends = Backends(), taps: dict | None = None):
    """Layers [first, last) against the pool, one traced body a run of layers (`layer_runs`: a run of several
    is one `lax.scan` over its stacked weights, carrying its record of the pool; the rest of the pool is read
    only there). params: grouped by run (`layer_runs.stack_params`), or per layer (then every layer unrolled).
    phases: by layer, for runs of one (the split layer). taps: a dict that receives the DSpark target layers'
    block inputs (`dspark.target_features` reads them), by layer."""
    freqs = model.freqs_for(cfg)
    carry = Carry()
    groups = layer_runs.stack_params(params, cfg, stack=False)[layer_runs.RUNS_KEY]  # a per-layer tree: unrolled
    for r, run in layer_runs.runs_between(cfg, first, last):
        phase = phases.get(run.first, "full")
        tapped = taps is not None and any(i in cfg.dspark_target_layer_ids for i in run.layers)

        def body(state, lp, i, run, phase=phase, tapped=tapped):
            h, pre, rec, carry = state
            if run.n == 1 and i in cfg.engram_layer_ids and phase != "attn_only":  # (a run of one: i static)
                with jax.named_scope("engram"):
                    rows = b.rows[cfg.engram_layer_ids.index(i)]
                    text = None if b.image_mask is None else ~b.image_mask
                    h = engram.engram(h, rows, lp["engram"], cfg, num, text, ops=backends.ops)
            tap = h if tapped else None
            if phase == "kv_only":
                with jax.named_scope("attention"):
                    x = rms_norm(mhc.collapse(h, pre), lp["attn_norm"], cfg.norm_eps)
                    _, rec, carry = run_attention(x, lp["attn"], run, i, cfg, num, pool, rec, b, carry,
                                                  freqs[run.plan.layer], phase, backends)
                return (h, pre, rec, carry), tap

            def attn_fn(x, state):
                rec, carry = state
                y, rec, carry = run_attention(x, lp["attn"], run, i, cfg, num, pool, rec, b, carry,
                                              freqs[run.plan.layer], phase, backends)
                return y, (rec, carry)

            h, pre, (rec, carry) = model.block(h, pre, lp, i, cfg, num, attn_fn, (rec, carry),
                                               image_mask=b.image_mask, ops=backends.ops)
            return (h, pre, rec, carry), tap

        (h, pre, rec, carry), ys = layer_runs.scan(body, (h, pre, pool.runs[r], carry), run, groups[r])
        pool = pool.with_run(r, rec)
        if tapped:
            taps.update({i: ys[k] for k, i in enumerate(run.layers) if i in cfg.dspark_target_layer_ids})
    return h, pre, pool


def _last_rows(x, n_valid, n: int):
    """x [B, T, ...] -> the last n valid rows [B, n, ...] (left-padded by clamping to row 0)."""
    T = x.shape[1]
    t = n_valid[:, None] - n + jnp.arange(n)[None]
    t = jnp.clip(t, 0, T - 1)
    return jnp.take_along_axis(x, t.reshape(*t.shape, *([1] * (x.ndim - 2))), axis=1)


def sample(logits: jax.Array, s: Sampling, filtered: bool) -> jax.Array:
    """logits [B, V] -> token ids [B]: greedy at temperature 0, else a draw (`spec_sampling.plain_draw`), filtered
    by top-k / top-p where filtered. The engine's sampling program (`Programs.sample`), run only for steps with
    rows that draw; the host picks filtered from its rows (`spec_sampling.row_branches`): the filters sort every
    row over the vocabulary (0.9 ms at batch 64 on the H200), which the OpenAI defaults do not ask for."""
    greedy = jnp.argmax(logits, -1)
    sampled, _ = spec_sampling.row_branches(s)
    return jnp.where(sampled, spec_sampling.plain_draw(logits, s, filtered), greedy).astype(jnp.int32)


def _head(params, h, pre, b: Batch, cfg) -> tuple[jax.Array, jax.Array]:
    """-> logits [B, V] at each row's last valid token, their argmax int32 [B]. Sampling is its own program
    (`Programs.sample`), run only for steps with rows that draw: the model's program has no branch whose
    predicate the host must read, so its call returns once launched."""
    h_last = _last_rows(h, b.n_valid, 1)
    pre_last = _last_rows(pre, b.n_valid, 1)
    logits = model.head(params, h_last, pre_last, cfg)[:, 0]
    return logits, jnp.argmax(logits, -1).astype(jnp.int32)


def _dspark_write(params, pool: KVPool, b: Batch, taps: dict, cfg: ModelConfig, num: Numerics, ops) -> KVPool:
    """The chunk's DSpark context keys (from the target layers' block inputs `taps`) into each stage's ring."""
    pos = b.pos0[:, None] + jnp.arange(b.tokens.shape[1], dtype=jnp.int32)[None]
    feats = dspark.target_features([taps[i] for i in cfg.dspark_target_layer_ids])
    ctx = dspark.project_context(params, feats, cfg, num, ops)
    rings = []
    for rec, kv in zip(pool.dspark, dspark.context_kv(params, ctx, pos, cfg, num, ops)):
        kq, ks = quant.fp8_quantize(kv)
        rq = kl.write_ring(kl.read_slots(rec.swa_q, b.slot), kq, b.pos0, b.n_valid)
        rs = kl.write_ring(kl.read_slots(rec.swa_s, b.slot), quant.ue8m0_encode(ks), b.pos0, b.n_valid)
        rings.append(dataclasses.replace(rec, swa_q=kl.write_slots(rec.swa_q, b.slot, rq),
                                         swa_s=kl.write_slots(rec.swa_s, b.slot, rs)))
    return dataclasses.replace(pool, dspark=rings)


def _dspark_draft(params, pool: KVPool, b: Batch, anchor_ids, anchor_pos, samp: Sampling, k: int,
                  cfg: ModelConfig, num: Numerics, ops, branch: int | None = None):
    """One block drafted a row from its DSpark rings: anchor_ids [B] at anchor_pos [B] (the newest token; the
    rings hold the context before it, from the rows' decoder ring start on). Greedy rows take each position's
    argmax, sampled rows draw (`spec_sampling.draft_sampler`) under branch (`spec_sampling.verify`'s). The
    block's first k states go to the pool: the next step recomputes the distributions its drafts were drawn
    from. -> (pool, drafts int32 [B, k], their confidence logits float32 [B, k])."""
    lo = b.ring_lo[:, -1]
    ctx_k = []
    for rec in pool.dspark:
        R = rec.swa_q.shape[1]
        ctx_k.append(_dequant_fp8_rows(kl.read_slots(rec.swa_q, b.slot), kl.read_slots(rec.swa_s, b.slot)))
    ctx_pos = kl.ring_positions(anchor_pos, R, lo)
    states = dspark.draft_states(params, ctx_k, ctx_pos, anchor_ids, anchor_pos, cfg, num, ops)[:, :k]
    head = dspark.head_logits(params, states)

    def block(branch: int):
        sampler = (dspark.greedy if branch == spec_sampling.GREEDY else
                   spec_sampling.draft_sampler(samp, branch == spec_sampling.FILTERED))
        drafts, _, conf = dspark.draft_from_head(params, head, states, anchor_ids, num, sampler)
        return drafts, conf

    if branch is not None:
        drafts, conf = block(branch)
    else:  # one branch index for the block's k draws (a host round trip on a GPU), not one a draw
        drafts, conf = jax.lax.switch(spec_sampling.batch_branch(samp),
                                      [functools.partial(block, i) for i in spec_sampling.BRANCHES])
    pool = dataclasses.replace(pool, dspark_states=kl.write_slots(pool.dspark_states, b.slot,
                                                                  states.astype(pool.dspark_states.dtype)))
    return pool, drafts, conf


def _spec(params, pool: KVPool, b: Batch, samp: Sampling, has_q: jax.Array, forced: jax.Array, n_verify: jax.Array,
          *, cfg: ModelConfig, num: Numerics, backends: Backends = Backends(), spec_tokens: int = 0,
          branch: int | None = None):
    """One speculative decode step: verify and draft in one call. Row b's chunk is [maybe the token before,
    anchor a (its newest token), drafts d_1..d_n] at positions pos0 .., n = n_verify [B] <= k the drafts it
    verifies (`spec_sampling.verify`; the rest of the k + 2 columns are padding: no KV, ring or compressor write,
    no page); n_valid = its real length (n + 1, or n + 2 when it re-runs the token before the anchor: a chunk
    must start at an even position, so that the ratio-2 compressors never read a pending state that rejected
    drafts overwrote). The target's logits after a and after each d_i decide how many drafts a row accepts and
    the token after them (the bonus; has_q [B]: the row's drafts came from the drafter's previous step, whose
    states the pool holds). The chunk's DSpark context keys go into the rings and the next block is drafted from
    the bonus. forced [B] (bool, traced: one program either way): accept every verified draft (benchmarks).
    branch: the batch's sampling branch (`spec_sampling.verify`'s), chosen on the host (`SpeculativeConfig.
    greedy_program`: GREEDY, no sampling in the program, or FILTERED), or None: a `lax.switch` on the device.
    -> (pool, logits [B, k + 1, V] after a and each d_i (past n: padding), tokens [B, k + 1] (the accepted drafts,
    then the bonus), accepted count [B], next drafts [B, k], their confidence logits [B, k])."""
    with jax.named_scope("embed"):
        if isinstance(b.feed, SpecFeed):
            b, n_verify = _spec_fed(params, b, cfg, n_verify)
        h, pre = model.embed(params, b.tokens, cfg, num)
    return _spec_layers(params, pool, b, h, pre, samp, has_q, forced, n_verify, 0, cfg=cfg, num=num,
                        backends=backends, spec_tokens=spec_tokens, branch=branch)


def _spec_rest(params, pool: KVPool, b: Batch, h, pre, samp: Sampling, has_q: jax.Array, forced: jax.Array,
               n_verify: jax.Array, *, cfg: ModelConfig, num: Numerics, backends: Backends = Backends(),
               spec_tokens: int = 0, branch: int | None = None):
    """`_spec` from layer `split_layer` on, on `_decode_first`'s stream of the same chunk (the split layer starts a
    fresh indexer carry, as in `_decode_rest`): with it, `_spec`'s step (on the CPU its logits ~4e-6 from `_spec`'s:
    the speculative programs compile with XLA's fast-compile preset, `_decode_first` without). DSpark's target
    layers must lie at or past the split (`dspark_splits`). -> `_spec`'s outputs."""
    if isinstance(b.feed, SpecFeed):  # resolved again as `_decode_first` did (the same inputs)
        b, n_verify = _spec_fed(params, b, cfg, n_verify, any(i >= cfg.split_layer for i in cfg.engram_layer_ids))
    return _spec_layers(params, pool, b, h, pre, samp, has_q, forced, n_verify, cfg.split_layer, cfg=cfg, num=num,
                        backends=backends, spec_tokens=spec_tokens, branch=branch)


def dspark_splits(cfg: ModelConfig) -> bool:
    """Whether a speculative step can be cut at the split layer (`_spec_rest`): every layer DSpark reads comes after
    it, so the first program needs no tap."""
    return 0 < cfg.split_layer < cfg.n_layers and all(i >= cfg.split_layer for i in cfg.dspark_target_layer_ids)


def _spec_layers(params, pool: KVPool, b: Batch, h, pre, samp: Sampling, has_q, forced, n_verify, start: int, *,
                 cfg: ModelConfig, num: Numerics, backends: Backends, spec_tokens: int, branch: int | None):
    """`_spec` from layer `start`'s input stream h, pre-mix pre on: the layers, verify and draft."""
    k = spec_tokens
    taps: dict = {}
    h, pre, pool = _layers(params, pool, b, h, pre, cfg, num, start, cfg.n_layers, {}, backends, taps)
    B, T = b.tokens.shape
    off = jnp.clip(b.n_valid - (n_verify + 1), 0, T - k - 1)  # the anchor's row
    rows = off[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]  # [B, k + 1]: a, d_1 .. d_k
    toks = jnp.take_along_axis(b.tokens, rows, axis=1)  # [B, k + 1]: a, d_1 .. d_k
    drafts_in = toks[:, 1:]
    with jax.named_scope("head_sample"):
        hs = jnp.take_along_axis(h, rows[:, :, None, None], axis=1)
        ps = jnp.take_along_axis(pre, rows[:, :, None], axis=1)
        logits = model.head(params, hs, ps, cfg)  # [B, k + 1, V]
        prev_states = kl.read_slots(pool.dspark_states, b.slot)  # [B, k, D]: the states d_1 .. d_k came from

        def draft_logits():  # the drafter's logits of d_i, whose Markov bias read d_{i-1} (d_0 = a)
            return dspark.draft_logits(params, prev_states, toks[:, :k], cfg, num)[0]

        m, bonus = spec_sampling.verify(logits, drafts_in, draft_logits, has_q, samp, n_verify, branch)
    m = jnp.where(forced, n_verify, m)
    forced_bonus = jnp.argmax(jnp.take_along_axis(logits, n_verify[:, None, None], axis=1)[:, 0], -1)
    bonus = jnp.where(forced, forced_bonus.astype(jnp.int32), bonus)  # forced [B]
    i = jnp.arange(k + 1, dtype=jnp.int32)[None]
    out = jnp.where(i < m[:, None], jnp.pad(drafts_in, ((0, 0), (0, 1))), bonus[:, None])
    with jax.named_scope("dspark"):
        pool = _dspark_write(params, pool, b, taps, cfg, num, backends.ops)
        anchor_pos = b.pos0 + off + m + 1
        pool, nxt, conf = _dspark_draft(params, pool, b, bonus, anchor_pos, samp, k, cfg, num, backends.ops, branch)
    return pool, logits, out, m, nxt, conf


def _full(params, pool: KVPool, b: Batch, *, cfg: ModelConfig, num: Numerics, backends: Backends = Backends(),
          dspark_seed: bool = False):
    """All layers on the batch's chunk. -> (pool, logits [B, V] at each row's last valid token, their argmax [B]).
    backends (`backends.Backends`): an attention backend other than 'xla' runs the fused kernels (decode: KV
    writes, indexer, attention; longer chunks: attention, one kernel row per query token) with its options; its
    ops run the linears, MoE and mHC sites. dspark_seed: also write the chunk's DSpark context keys (a prefill
    under speculative decoding)."""
    with jax.named_scope("embed"):
        b = _fed(params, b, cfg)
        h, pre = model.embed(params, b.tokens, cfg, num)
        h = model.place_images(h, b.image_embeds, b.image_mask)
    taps = {} if dspark_seed else None
    h, pre, pool = _layers(params, pool, b, h, pre, cfg, num, 0, cfg.n_layers, {}, backends, taps)
    if dspark_seed:
        pool = _dspark_write(params, pool, b, taps, cfg, num, backends.ops)
    with jax.named_scope("head"):
        logits, tok = _head(params, h, pre, b, cfg)
    return pool, logits, tok


def _encoder(params, pool: KVPool, b: Batch, *, cfg: ModelConfig, num: Numerics, backends: Backends = Backends(),
             replay_tokens: int | None = None):
    """Layers [0, split) and the split layer's KV writes. -> (pool, stream [B, n, hc, D] and pre-mix
    [B, n, hc] at the split layer's input for each row's last n = replay_tokens (None: window) valid tokens)."""
    h, pre = model.embed(params, b.tokens, cfg, num)
    h = model.place_images(h, b.image_embeds, b.image_mask)
    split = cfg.split_layer
    h, pre, pool = _layers(params, pool, b, h, pre, cfg, num, 0, split + 1, {split: "kv_only"}, backends)
    n = replay_tokens or cfg.window_size
    return pool, _last_rows(h, b.n_valid, n), _last_rows(pre, b.n_valid, n)


def _decoder(params, pool: KVPool, b: Batch, h, pre, *, cfg: ModelConfig, num: Numerics,
             backends: Backends = Backends(), dspark_seed: bool = False):
    """The rest of the split layer (its KV is in the pool) and the layers after it, on the trimmed rows.
    b.pos0 = N - n_valid. dspark_seed: also write the rows' DSpark context keys (the target layers are decoder
    layers). -> (pool, logits [B, V], their argmax [B])."""
    split = cfg.split_layer
    taps = {} if dspark_seed else None
    h, pre, pool = _layers(params, pool, b, h, pre, cfg, num, split, cfg.n_layers, {split: "attn_only"}, backends,
                           taps)
    if dspark_seed:
        pool = _dspark_write(params, pool, b, taps, cfg, num, backends.ops)
    logits, tok = _head(params, h, pre, b, cfg)
    return pool, logits, tok


def _decode_first(params, pool: KVPool, b: Batch, *, cfg: ModelConfig, num: Numerics,
                  backends: Backends = Backends()):
    """A decode step's embedding and layers [0, split). -> (pool, stream [B, 1, hc, D], pre-mix [B, 1, hc])."""
    with jax.named_scope("embed"):
        b = _fed(params, b, cfg)
        h, pre = model.embed(params, b.tokens, cfg, num)
    h, pre, pool = _layers(params, pool, b, h, pre, cfg, num, 0, cfg.split_layer, {}, backends)
    return pool, h, pre


def rest_batch(b: Batch, cfg: ModelConfig) -> Batch:
    """A decode batch as `run_decode_rest` takes it: without the Engram rows (or their feed) where no Engram layer is
    at or past the split (Flash: layers 1 and 14, split 20), so that the step packs and sends them once, not twice."""
    if any(i >= cfg.split_layer for i in cfg.engram_layer_ids) or isinstance(b.feed, SpecFeed):
        return b  # (a speculative feed also sets the chunks and their positions)
    return dataclasses.replace(b, rows=[], feed=None)


def _decode_rest(params, pool: KVPool, b: Batch, h, pre, *, cfg: ModelConfig, num: Numerics,
                 backends: Backends = Backends()):
    """Layers [split, L) and the head on `_decode_first`'s stream: with it, `_full`'s decode step bit for bit (the
    split layer starts a fresh indexer carry, as the replay decoder's program does, so nothing else crosses the
    cut). -> (pool, logits [B, V], their argmax [B])."""
    b = _fed(params, b, cfg)
    h, pre, pool = _layers(params, pool, b, h, pre, cfg, num, cfg.split_layer, cfg.n_layers, {}, backends)
    with jax.named_scope("head"):
        logits, tok = _head(params, h, pre, b, cfg)
    return pool, logits, tok


@jax.jit
def append_tail(tail_h, tail_p, new_h, new_p, m):
    """A replayed prompt's encoder rows so far (right-aligned: the newest last) with the next chunk's appended:
    new_* [R, ...] are a chunk's last R output rows, of which the last m are real. Fixed shapes, m traced: one
    compile for every chunk length. -> (h [R, hc, D], pre [R, hc])."""
    keep = jnp.arange(tail_h.shape[0]) < tail_h.shape[0] - m

    def merge(t, n):
        return jnp.where(keep.reshape(-1, *([1] * (t.ndim - 1))), jnp.roll(t, -m, axis=0), n)

    return merge(tail_h, new_h), merge(tail_p, new_p)


@jax.jit
def left_align(h, pre, n):
    """Rows [B, R, ...] whose last n[b] are real -> those rows first (the decoder's layout: positions N - n ..)."""
    R = h.shape[1]
    roll = jax.vmap(lambda x, k: jnp.roll(x, k - R, axis=0))
    return roll(h, n), roll(pre, n)


_STATIC = ("cfg", "num", "backends")
_ENCODER_STATIC = _STATIC + ("replay_tokens",)
_PREFILL_STATIC = _STATIC + ("dspark_seed",)
_SPEC_STATIC = _STATIC + ("spec_tokens", "branch")
_SAMPLE_STATIC = ("filtered",)
# XLA's CPU backend at full optimization took over 7 minutes on the tiny preset's speculative program (the plain
# programs: ~10 s); its fast-compile preset, 18-19 s. The plain programs keep the default: the preset compiles them no
# faster and runs them ~1.5x slower. Only where the program compiles for the CPU (`_PlatformJit`).
_SPEC_CPU_OPTIONS = {"xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_COMPILE"}


class _PlatformJit:
    """`jax.jit(fn, **kw)` with `cpu_options` as its compiler options where jax's default backend is the CPU, made
    at the first use (the platform is known only once jax is initialized, after `jax.distributed` where it runs).
    Forwards what callers use of a jitted function: calls, `lower`, `trace`, `_cache_size`."""

    def __init__(self, fn, cpu_options: dict, **kw):
        self._fn, self._cpu_options, self._kw = fn, cpu_options, kw

    @functools.cached_property
    def jitted(self):
        cpu = jax.default_backend() == "cpu"
        return jax.jit(self._fn, **self._kw, **({"compiler_options": self._cpu_options} if cpu else {}))

    def __call__(self, *args, **kw):
        return self.jitted(*args, **kw)

    def lower(self, *args, **kw):
        return self.jitted.lower(*args, **kw)

    def trace(self, *args, **kw):
        return self.jitted.trace(*args, **kw)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()


def _program(name: str, fn, static: tuple, cpu_options: dict | None = None, rank=None, **jit_kw) -> "Program":
    """fn(params, pool, *args, **static) jitted as an engine program: the pool donated, the host arguments in one
    transfer (`host_rows`), `cpu_options` where it compiles for the CPU (`_PlatformJit`), the per-rank arguments
    placed over data ranks (rank: their sharding, on a mesh)."""
    kw = dict(static_argnames=static + ("layout",), donate_argnames=("pool",), **jit_kw)
    fn = host_rows.one_transfer(fn)
    jitted = jax.jit(fn, **kw) if cpu_options is None else _PlatformJit(fn, cpu_options, **kw)
    return Program(name, jitted, rank, cpu_options)


@dataclasses.dataclass(frozen=True)
class Program:
    """An engine program called as fn(params, pool, *args, **static): the host arrays packed into one transfer
    (`host_rows.split`), placed over data ranks on a mesh (rank: their sharding), then run by the engine's
    executable for that call's shapes (`executables`: kept from warm-up's compile or loaded from the program
    store, so a call traces nothing) or else through jit."""

    name: str
    jitted: Any
    rank: jax.sharding.NamedSharding | None = None
    compiler_options: dict | None = dataclasses.field(default=None, hash=False)
    executables: executables.Executables | None = dataclasses.field(default=None, compare=False, hash=False)

    def _args(self, params, pool, args: tuple, static: dict) -> tuple[tuple, dict]:
        rows, rest, layout = host_rows.split(args)
        placed = (pool, rows, rest) if self.rank is None else sharding.put((pool, rows, rest), self.rank)
        return (params, *placed), {"layout": layout, **static}

    def __call__(self, params, pool, *args, **static):
        a, kw = self._args(params, pool, args, static)
        if self.executables:  # any kept: an engine without warm-up skips the lookup
            compiled = self.executables.get(self.name, executables.call_signature(a, kw))
            if compiled is not None:
                return compiled(*a)
        return self.jitted(*a, **kw)

    def lower(self, params, pool, *args, **static):
        a, kw = self._args(params, pool, args, static)
        return self.jitted.lower(*a, **kw)

    def trace(self, params, pool, *args, **static):
        a, kw = self._args(params, pool, args, static)
        return self.jitted.trace(*a, **kw)

    def _store_key(self, a: tuple, kw: dict) -> str | None:
        store = self.executables.store if self.executables is not None else None
        if store is None:
            return None
        try:
            return executables.key(self.name, a, kw, self.compiler_options)
        except executables.Unkeyable as e:
            log.warning("program store: %s is not stored (an argument has no stable description: %s)", self.name, e)
            return None

    def find(self, params, pool, *args, load: bool = True, **static) -> tuple[str | None, bool]:
        """This call's program store key (None: no store, or the call cannot be keyed) and whether the store holds
        its executable; with load, that executable is loaded and kept for the engine's calls of these shapes (False
        where it does not load)."""
        if self.executables is None:
            return None, False
        a, kw = self._args(params, pool, args, static)
        k = self._store_key(a, kw)
        if k is None or not load:
            return k, k is not None and self.executables.store.has(k)
        compiled = self.executables.store.load(k)
        if compiled is not None:
            self.executables.put(self.name, executables.call_signature(a, kw), compiled)
        return k, compiled is not None

    def keep(self, compiled, params, pool, *args, key: str | None, **static) -> None:
        """Keeps a compiled executable of this call (`lower(...).compile()`) for the engine's calls of these shapes;
        with key (`find`'s), writes it to the program store, before it first runs (one that ran did not serialize
        on the CPU: "`LessThan` is not serializable"). Only an executable XLA compiled in this process is stored:
        one loaded from jax's persistent cache and serialized again lost its code on the CPU ("Function
        multiply_convert_fusion.72 not found" when the copy ran)."""
        if self.executables is None:
            return
        a, kw = self._args(params, pool, args, static)
        if key is not None:
            self.executables.store.save(key, compiled)
        self.executables.put(self.name, executables.call_signature(a, kw), compiled)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()


class Programs:
    """The engine's programs (`run_full`, `run_encoder`, `run_decoder`, `run_decode_first`, `run_decode_rest`,
    `run_spec`, `run_spec_rest`), jitted for one placement, each taking (params, pool, batch, ...) and returning the
    new pool (donated). A call's host arrays reach the device as one buffer (`host_rows`). `sample(logits, sampling,
    filtered=)`: the tokens of a step with rows that draw (`sample`).

    mesh None: one device. On a mesh (`dsv41.sharding.make_mesh`) each program runs per data rank: a
    `shard_map` manual over the data axis takes each rank's rows of the batch and its own pool (both stacked on
    axis 0) and leaves the tensor axis to XLA, which partitions heads, widths and the vocabulary as the weights
    are split (`param_shardings`: the tree of the params' shardings, as placed) and adds the reductions. Expert
    parallelism is an `Ops.routed_experts` (`sharding.ExpertParallel`) inside that region.

    An engine runs them `bound` to its own `executables.Executables`; the jit caches stay shared."""

    def __init__(self, mesh=None, param_shardings=None):
        self.mesh = mesh
        if mesh is None:
            self.run_full = _program("full", _full, _PREFILL_STATIC)
            self.run_decoder = _program("decoder", _decoder, _PREFILL_STATIC)
            self.run_encoder = _program("encoder", _encoder, _ENCODER_STATIC)
            self.run_decode_first = _program("decode_first", _decode_first, _STATIC)
            self.run_decode_rest = _program("decode_rest", _decode_rest, _STATIC)
            self.run_spec = _program("spec", _spec, _SPEC_STATIC, _SPEC_CPU_OPTIONS)
            self.run_spec_rest = _program("spec_rest", _spec_rest, _SPEC_STATIC, _SPEC_CPU_OPTIONS)
            self.sample = jax.jit(sample, static_argnames=_SAMPLE_STATIC)
            return
        rank = sharding.rank_sharding(mesh)
        specs = jax.tree_util.tree_map(sharding.manual_spec, param_shardings)
        R = rank.spec
        # with one tensor rank nothing is left for XLA to partition: every axis manual
        manual = set(mesh.axis_names) if mesh.shape[sharding.TENSOR] == 1 else {sharding.DATA}

        def per_rank(body, n_rank_args):
            def fn(params, *args, **static):
                f = functools.partial(body, **static)
                return jax.shard_map(f, mesh=mesh, in_specs=(specs,) + (R,) * n_rank_args, out_specs=R,
                                     axis_names=manual, check_vma=False)(params, *args)
            return fn

        full, enc, dec = per_rank(_full, 2), per_rank(_encoder, 2), per_rank(_decoder, 4)
        first, rest = per_rank(_decode_first, 2), per_rank(_decode_rest, 4)
        spec, spec_rest = per_rank(_spec, 6), per_rank(_spec_rest, 8)

        def run_full(params, pool, b, *, cfg, num, backends=Backends(), dspark_seed=False):
            return full(params, pool, b, cfg=cfg, num=num, backends=backends, dspark_seed=dspark_seed)

        def run_encoder(params, pool, b, *, cfg, num, backends=Backends(), replay_tokens=None):
            return enc(params, pool, b, cfg=cfg, num=num, backends=backends, replay_tokens=replay_tokens)

        def run_decoder(params, pool, b, h, pre, *, cfg, num, backends=Backends(), dspark_seed=False):
            return dec(params, pool, b, h, pre, cfg=cfg, num=num, backends=backends, dspark_seed=dspark_seed)

        def run_decode_first(params, pool, b, *, cfg, num, backends=Backends()):
            return first(params, pool, b, cfg=cfg, num=num, backends=backends)

        def run_decode_rest(params, pool, b, h, pre, *, cfg, num, backends=Backends()):
            return rest(params, pool, b, h, pre, cfg=cfg, num=num, backends=backends)

        def run_spec(params, pool, b, samp, has_q, forced, n_verify, *, cfg, num, backends=Backends(),
                     spec_tokens=0, branch=None):
            return spec(params, pool, b, samp, has_q, forced, n_verify, cfg=cfg, num=num, backends=backends,
                        spec_tokens=spec_tokens, branch=branch)

        def run_spec_rest(params, pool, b, h, pre, samp, has_q, forced, n_verify, *, cfg, num, backends=Backends(),
                          spec_tokens=0, branch=None):
            return spec_rest(params, pool, b, h, pre, samp, has_q, forced, n_verify, cfg=cfg, num=num,
                             backends=backends, spec_tokens=spec_tokens, branch=branch)

        def jit(fn, static=_STATIC, out=rank, cpu_options=None):
            return _program("mesh_" + fn.__name__.removeprefix("run_"), fn, static, cpu_options, rank,
                            out_shardings=out)

        # across processes the host reads every rank's sampled tokens: replicated, each host has them locally
        tok = sharding.replicated(mesh) if jax.process_count() > 1 else rank
        self.run_full = jit(run_full, _PREFILL_STATIC, out=(rank, rank, tok))
        self.run_decoder = jit(run_decoder, _PREFILL_STATIC, out=(rank, rank, tok))
        self.run_encoder = jit(run_encoder, _ENCODER_STATIC)
        self.run_decode_first = jit(run_decode_first)
        self.run_decode_rest = jit(run_decode_rest, out=(rank, rank, tok))
        self.run_spec = jit(run_spec, _SPEC_STATIC, out=(rank, rank, tok, tok, tok, tok),
                            cpu_options=_SPEC_CPU_OPTIONS)
        self.run_spec_rest = jit(run_spec_rest, _SPEC_STATIC, out=(rank, rank, tok, tok, tok, tok),
                                 cpu_options=_SPEC_CPU_OPTIONS)
        # (logits, sampling): `_PerRankArgs` places the sampling rows; the logits are the step's, placed already
        self.sample = _PerRankArgs(jax.jit(sample, static_argnames=_SAMPLE_STATIC, out_shardings=tok), rank)

    def bound(self, ex: executables.Executables) -> "Programs":
        """These programs (their jit caches shared) running an engine's own executables (`Program.executables`)."""
        out = copy.copy(self)
        for name in ("run_full", "run_encoder", "run_decoder", "run_decode_first", "run_decode_rest", "run_spec",
                     "run_spec_rest"):
            setattr(out, name, dataclasses.replace(getattr(self, name), executables=ex))
        return out


@dataclasses.dataclass(frozen=True)
class _PerRankArgs:
    """A mesh program that first places its per-rank arguments (host batches: each device receives only its rank's
    rows; the pool and the step's outputs are already there) split over data ranks. (jit's in_shardings would do
    it, but do not combine with the static keyword arguments every call passes.)"""

    fn: Any
    rank: jax.sharding.NamedSharding

    def _args(self, params, *args):
        return (params, *sharding.put(args, self.rank))

    def __call__(self, *args, **static):
        return self.fn(*self._args(*args), **static)

    def lower(self, *args, **static):
        return self.fn.lower(*self._args(*args), **static)

    def _cache_size(self) -> int:
        return self.fn._cache_size()


ONE_DEVICE = Programs()
run_full, run_encoder, run_decoder = ONE_DEVICE.run_full, ONE_DEVICE.run_encoder, ONE_DEVICE.run_decoder
