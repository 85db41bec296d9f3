"""Tests of the sparse MQA indexer logits kernel + top-k (pallas_kernels/indexer_logits).

CPU: the Mosaic GPU kernel runs in the Mosaic GPU interpreter at tiny shapes (IH=8..32, ID=64/128, a few tiles)
against the plain-jnp reference; in interpret mode the producer's PTX gather + dequant is replaced by an equivalent
jnp dequant of rows the wrapper pre-gathers (the PTX is the one verified bit-exact on the H200 in sparse_attention;
its new UE8M0 -> bf16x2 scale trick is checked in numpy below). The top-k / candidate-block wrappers are checked
against today's XLA path (`_context_index_keys` + `indexer.scores` + `candidate_mask` + `select_topk`).
One test lowers the kernel for CUDA at Flash shapes (whole Pallas -> Mosaic GPU lowering, no GPU needed).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import indexer
from pallas_kernels import indexer_logits as il
from host_arrays import put


def coarse(rng, shape):
    """Values on a coarse grid: every dot product and head sum is exact in f32, whatever the summation order."""
    return put(rng.integers(-4, 5, shape) / 4.0, jnp.bfloat16)


def make_pool(seed, B, S, IH=32, ID=128, E=16, pages_per_row=4, *, exact=True):
    """Fresh random indexer inputs (numpy RNG: no per-op compiles on the CPU test machine)."""
    rng = np.random.default_rng(seed)
    P = B * pages_per_row + 3                          # a few pages nobody uses
    if exact:
        q, w = coarse(rng, (B, S, IH, ID)), coarse(rng, (B, S, IH))
    else:
        q = put(rng.standard_normal((B, S, IH, ID)), jnp.bfloat16)
        w = put(rng.standard_normal((B, S, IH)), jnp.bfloat16)
    pk = put(rng.integers(0, 256, (P, E, ID // 2)), jnp.uint8)
    sc = put(rng.integers(125, 130, (P, E, ID // 32)), jnp.uint8)
    bt = put(rng.permutation(P)[: B * pages_per_row].reshape(B, pages_per_row), jnp.int32)
    return q, w, pk, sc, bt


def jit(f, **static):
    return jax.jit(functools.partial(f, **static))


# Eagerly, each of their ops is an XLA compile (~40 ms on the CPU).
_live_tiles = jax.jit(il.live_tiles)
_blocks_to_mask = jax.jit(il.blocks_to_mask, static_argnums=(1, 2))


def assert_scores_close(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    fin = np.isfinite(ref)
    # bf16 results: equal, or one bf16 ulp apart where a different f32 summation order crosses a rounding point.
    np.testing.assert_allclose(out[fin], ref[fin], rtol=2 ** -7, atol=1e-30)


@pytest.mark.parametrize("B,S,IH,ID,N,splits,exact", [
    (2, 1, 32, 128, 128, 2, False),      # Flash head shape, 2 tiles, one per CTA
    (1, 2, 16, 64, 200, 1, True),        # two queries in the wgmma N, ragged N (padded tile), 4 tiles in one CTA
])
def test_entry_scores_interpret(B, S, IH, ID, N, splits, exact):
    q, w, pk, sc, _ = make_pool(B * 10 + N, B, S, IH, ID, E=16, exact=exact)
    rows = np.random.default_rng(N).integers(-1, pk.shape[0] * pk.shape[1], (B, N)).astype(np.int32)
    rows[0, :5] = -1
    rows[-1, -3:] = -1
    rows = jax.device_put(rows)
    ref = jit(il.entry_scores_reference)(q, w, pk, sc, rows)
    out = jit(il.entry_scores, backend="interpret", num_splits=splits)(q, w, pk, sc, rows)
    assert out.shape == (B, S, N)
    assert_scores_close(out, ref)
    if exact:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_entry_scores_skip_tiles_past_each_rows_last_entry():
    """Rows valid only at their start (a short context in a wide block table): the kernel computes each row's
    tiles up to its last valid entry (`live_tiles`), whole CTAs of a split row none; the scores are the
    reference's, -inf past the end."""
    B, S, IH, ID, N = 3, 1, 16, 64, 512  # 8 tiles of 64, 4 splits of 2 tiles
    q, w, pk, sc, _ = make_pool(11, B, S, IH, ID, E=16, exact=True)
    rows = np.full((B, N), -1, np.int32)
    rng = np.random.default_rng(3)
    for b, n in enumerate((70, 0, 130)):  # 2 live tiles, none, 3 (a -1 hole inside the last)
        rows[b, :n] = rng.integers(0, pk.shape[0] * pk.shape[1], n)
    rows[2, 100] = -1
    rows = jax.device_put(rows)
    np.testing.assert_array_equal(np.asarray(_live_tiles(rows)), [2, 0, 3])
    ref = jit(il.entry_scores_reference)(q, w, pk, sc, rows)
    out = jit(il.entry_scores, backend="interpret", num_splits=4)(q, w, pk, sc, rows)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert np.isneginf(np.asarray(out)[0, :, 70:]).all() and np.isfinite(np.asarray(out)[0, :, :70]).all()


def test_reference_matches_indexer_scores():
    """dequant_rows + scores_from_keys == programs' _context_index_keys + indexer.scores (row-major entries)."""
    B, S, E = 2, 3, 16
    q, w, pk, sc, bt = make_pool(7, B, S, E=E, exact=False)
    G = bt.shape[1] * E
    q_pos = put([[5, 40, 127], [0, 1, 90]], jnp.int32)
    from dsv41 import quant

    @jax.jit
    def both(q, w, pk, sc, bt, q_pos):
        s_ctx = il.context_scores(q, w, pk, sc, bt, q_pos, 2, G, backend="xla")
        keys = il.dequant_rows(pk, sc, il.pool_rows(jnp.tile(jnp.arange(G)[None], (B, 1)), bt, E, pk.shape[0]))
        keys_today = quant.fp4_dequantize(pk[bt], quant.ue8m0_decode(sc[bt]), 32).reshape(B, G, -1)
        return s_ctx, keys, keys_today

    s_ctx, keys, keys_today = both(q, w, pk, sc, bt, q_pos)
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(keys_today))
    # indexer.scores rounds with quant.round_to, which jit keeps (a bare astype pair would be dropped)
    ref = jax.jit(lambda *a: indexer.scores(*a, 2, quant.REFERENCE))(q, w, keys_today, q_pos)
    np.testing.assert_array_equal(np.asarray(s_ctx), np.asarray(ref))


@pytest.mark.parametrize("method", ["auto", "kernel"])
def test_context_topk_and_candidates_match_today(method):
    """Context mode (kernel, interpret) -> top-k and candidate blocks; candidates mode (kernel, interpret) -> top-k;
    both equal today's XLA path; candidate blocks give the same entry mask as indexer.candidate_mask. With the
    top-k by XLA ('auto') and by the threshold kernel ('kernel', entries and blocks)."""
    B, S, E, ratio = 2, 1, 16, 2
    cfg = il.IndexerConfig(index_topk=24, candidate_block_size=8, candidate_topk_blocks=5, topk_method=method)
    q, w, pk, sc, bt = make_pool(11, B, S, E=E, pages_per_row=8)
    G = bt.shape[1] * E                                                    # 128 entries = 2 tiles
    q_pos = put([[230], [37]], jnp.int32)                           # 115 and 19 visible entries
    rng = np.random.default_rng(3)
    q2, w2 = coarse(rng, q.shape), coarse(rng, w.shape)              # a later layer's queries

    @jax.jit
    def kernel_path(q, w, pk, sc, bt, q_pos, q2, w2):
        topk, cand = il.index_topk(q, w, pk, sc, bt, q_pos, ratio, num_entries=G, want_candidates=True, cfg=cfg,
                                   backend="interpret")
        # Later layer: candidates mode (block list padded to a whole tile of entries).
        cb = jnp.pad(cand[:, 0], ((0, 0), (0, 8 - cand.shape[-1])), constant_values=-1)
        topk_c, _ = il.index_topk(q2, w2, pk, sc, bt, q_pos, ratio, cand_blocks=cb, cfg=cfg, backend="interpret")
        return topk, cand, il.blocks_to_mask(cand, G, 8), topk_c

    @jax.jit
    def today_path(q, w, pk, sc, bt, q_pos, q2, w2):
        today = il.index_topk_xla_today(q, w, pk, sc, bt, q_pos, ratio, cfg=cfg)
        s_ctx = il.context_scores(q, w, pk, sc, bt, q_pos, ratio, G, backend="xla")
        mask = indexer.candidate_mask(s_ctx, q_pos, ratio, cfg)
        return today, mask, il.index_topk_xla_today(q2, w2, pk, sc, bt, q_pos, ratio, cand_mask=mask, cfg=cfg)

    # numpy copies: eagerly, each index of a jax.Array is a small program
    topk, cand, cand_mask, topk_c = map(np.asarray, kernel_path(q, w, pk, sc, bt, q_pos, q2, w2))
    today, mask, today_c = map(np.asarray, today_path(q, w, pk, sc, bt, q_pos, q2, w2))
    np.testing.assert_array_equal(topk, today)
    np.testing.assert_array_equal(cand_mask, mask)
    # Row 1 sees 19 entries = 3 blocks < 5: the list is -1 padded.
    assert (cand[1, 0, 3:] == -1).all() and (cand[1, 0, :3] == [0, 1, 2]).all()
    k = today_c.shape[-1]
    assert topk_c.shape[-1] >= k
    np.testing.assert_array_equal(topk_c[..., :k], today_c)
    assert (topk_c[..., k:] == -1).all()


@pytest.mark.parametrize("backend,method,topk_blocks", [
    ("xla", "auto", 3),          # lax.top_k merges; the block top-k
    ("xla", "radix", 64),        # radix-select merges; every seen block a candidate (no block top-k)
    ("interpret", "kernel", 3),  # the chunk-scoring and threshold kernels in the interpreter
])
def test_context_topk_blocks_equals_one_pass(backend, method, topk_blocks):
    """A prefill chunk's context-mode indexer by blocks of the table (`context_topk_blocks`: only the blocks some
    query sees, merged into the running top-k; candidates from the blocks' maxima) picks `index_topk`'s entries and
    candidate blocks over the whole table: ties (coarse values) to the lower id, queries that see fewer than k."""
    B, S, IH, ID, E, ratio = 2, 6, 64, 64, 16, 2
    cfg = il.IndexerConfig(index_topk=8, candidate_block_size=8, candidate_topk_blocks=topk_blocks,
                           topk_method=method)
    q, w, pk, sc, bt = make_pool(21, B, S, IH, ID, E=E, pages_per_row=8)
    G = bt.shape[1] * E  # 128 entries: 4 blocks of 32 (2 pages: twice the top-k, whole pages)
    q_pos = put([[250, 200, 140, 90, 60, 9], [40, 30, 20, 10, 5, 0]], jnp.int32)  # row 1: block 0 only

    @jax.jit
    def both(q, w, pk, sc, bt, q_pos):
        kw = dict(want_candidates=True, cfg=cfg, backend=backend)
        blocked = il.context_topk_blocks(q, w, pk, sc, bt, q_pos, ratio, block_entries=32, **kw)
        return blocked, il.index_topk(q, w, pk, sc, bt, q_pos, ratio, num_entries=G, **kw)

    (topk, cand), (want_topk, want_cand) = both(q, w, pk, sc, bt, q_pos)
    np.testing.assert_array_equal(np.asarray(topk), np.asarray(want_topk))
    np.testing.assert_array_equal(np.asarray(_blocks_to_mask(cand, G, 8)),
                                  np.asarray(_blocks_to_mask(want_cand, G, 8)))
    assert (np.asarray(topk)[1, 5] == -1).all() and (np.asarray(topk)[0, 0] >= 64).any()  # none seen; far blocks


def test_context_scores_of_a_prefill_chunk_in_query_groups():
    """A prefill chunk's S queries over the context (`context_scores`, S > the queries one kernel row takes):
    groups of query_group(IH) queries, the last one padded, each group a kernel row that skips the entries none of
    its queries sees. Interpreted kernel == the reference on the whole chunk, bit for bit (exact data)."""
    B, S, IH, ID, E, ratio = 2, 37, 64, 64, 16, 1
    assert il.query_group(IH) == 4  # 10 kernel rows a sequence, the last with one real query
    q, w, pk, sc, bt = make_pool(13, B, S, IH, ID, E=E, pages_per_row=4)
    G = bt.shape[1] * E
    q_pos = put([np.arange(S) + 20, np.arange(S)], jnp.int32)  # a chunk after 20 tokens; one from 0
    out = jit(il.context_scores, ratio=ratio, num_entries=G, backend="interpret")(q, w, pk, sc, bt, q_pos)
    ref = jit(il.context_scores, ratio=ratio, num_entries=G, backend="xla")(q, w, pk, sc, bt, q_pos)
    assert out.shape == (B, S, G)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert np.isfinite(np.asarray(out)[1, 0]).sum() == 1 and np.isfinite(np.asarray(out)[0, -1]).sum() == S + 20


def test_candidates_small_s_and_ties():
    """S=2 candidates [B, S, NB] (one kernel row per query), all-equal scores (ties -> lower ids), -1 blocks,
    partially visible last block. The wrapper logic is backend-independent: the reference backend keeps CI fast
    (the kernel's S>1 tile is covered by test_entry_scores_interpret)."""
    B, S, E, ratio = 1, 2, 16, 1
    cfg = il.IndexerConfig(index_topk=12, candidate_block_size=8, candidate_topk_blocks=8)
    q, w, pk, sc, bt = make_pool(5, B, S, E=E, pages_per_row=4)
    q = put(np.ones(q.shape), q.dtype)
    pk = put(np.full(pk.shape, 0x22), pk.dtype)   # every key element = 1.0 * scale: all scores tie
    sc = put(np.full(sc.shape, 127), sc.dtype)
    cb = put([[[0, 2, 5, 7, -1, -1, -1, -1], [1, 3, 4, -1, -1, -1, -1, -1]]], jnp.int32)
    q_pos = put([[43, 29]], jnp.int32)            # 44 and 30 visible entries
    out = {}
    out["xla"], _ = jit(il.index_topk, ratio=ratio, cfg=cfg, backend="xla")(q, w, pk, sc, bt, q_pos, cand_blocks=cb)
    want0 = list(range(8)) + [16, 17, 18, 19]                           # ties: the lowest visible ids first
    want1 = list(range(8, 16)) + [24, 25, 26, 27]
    assert np.asarray(out["xla"])[0, 0].tolist() == want0
    assert np.asarray(out["xla"])[0, 1].tolist() == want1


def test_candidate_blocks_mask_equivalence_random():
    """candidate_blocks -> mask == indexer.candidate_mask on bf16 scores with many ties and -inf."""
    cfg = il.IndexerConfig(index_topk=16, candidate_block_size=8, candidate_topk_blocks=7)
    B, S, G, ratio = 3, 2, 100, 4
    s = np.random.default_rng(1).integers(-3, 3, (B, S, G)).astype(np.float32)
    q_pos = put([[399, 100], [3, 9], [200, 250]], jnp.int32)

    @jax.jit
    def both(s, q_pos):
        vis = jnp.arange(G)[None, None] < il.visible_count(q_pos, ratio)[..., None]
        s = jnp.where(vis, s, -jnp.inf)
        blocks = il.candidate_blocks(s, q_pos, ratio, cfg)
        return blocks, il.blocks_to_mask(blocks, G, 8), indexer.candidate_mask(s, q_pos, ratio, cfg)

    blocks, got, mask = both(jax.device_put(s), q_pos)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(mask))
    b = np.asarray(blocks)
    for row in b.reshape(-1, b.shape[-1]):                                 # ascending, -1 only at the end
        v = row[row >= 0]
        assert (np.diff(v) > 0).all() and (row[len(v):] == -1).all()


def test_ue8m0_bf16x2_scale_trick():
    """The producer builds bf16x2 (2^(b-127), 2^(b-127)) as (b << 7) | (b << 23): check the bf16 half."""
    b = np.arange(256, dtype=np.uint32)
    bits = ((b << 7) | (b << 23)) & 0xFFFF
    as_f32 = (bits.astype(np.uint32) << 16).view(np.float32)
    want = (b << 23).view(np.float32)                                     # quant.ue8m0_decode
    np.testing.assert_array_equal(as_f32[:255], want[:255])
    assert np.isinf(as_f32[255])


def test_kernel_lowers_for_cuda_at_flash_shapes():
    """Pallas -> Mosaic GPU lowering (layouts, smem, wgmma shapes) at Flash shapes, on CPU."""
    sds = jax.ShapeDtypeStruct
    for B, S, N, P, E in ((64, 1, 16384, 8192, 128), (2, 8, 1024, 64, 64)):
        shapes = (sds((B, S, 32, 128), jnp.bfloat16), sds((B, S, 32), jnp.bfloat16), sds((P, E, 64), jnp.uint8),
                  sds((P, E, 4), jnp.uint8), sds((B, N), jnp.int32))
        low = jax.jit(il.entry_scores_kernel).trace(*shapes).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in low.as_text()[:200000]
    jax.jit(il.dequant_probe).trace(sds((64, 64, 64), jnp.uint8), sds((64, 64, 4), jnp.uint8),
                                    sds((64,), jnp.int32)).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
def test_gpu_dequant_probe_exact():
    """The PTX gather + dequant + swizzled store of one tile, read back: bit-exact vs dequant_rows."""
    _, _, pk, sc, _ = make_pool(3, 4, 1, E=64, pages_per_row=4)
    sc = jnp.asarray(np.random.default_rng(4).integers(110, 140, sc.shape), jnp.uint8)
    rows = jnp.asarray(np.random.default_rng(5).integers(-1, pk.shape[0] * 64, (64,)), jnp.int32)
    k, bias = il.dequant_probe(pk, sc, rows)
    ref = il.dequant_rows(pk, sc, rows[None])[0].astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(k.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(bias), np.where(np.asarray(rows) >= 0, 0.0, -np.inf))


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("B,ctx", [(1, 65536), (8, 16384)])
def test_gpu_candidates_flash(B, ctx):
    E, ratio = 64, 2
    G = ctx // ratio
    q, w, pk, sc, bt = make_pool(B, B, 1, E=E, pages_per_row=G // E, exact=False)
    nb = G // 8
    cb = jnp.sort(jax.vmap(lambda k: jax.random.permutation(k, nb)[:2048])(jax.random.split(jax.random.key(0), B)))
    q_pos = jnp.full((B, 1), ctx - 1, jnp.int32)
    s, _ = il.candidate_scores(q, w, pk, sc, bt, cb, q_pos, ratio)
    s_ref, _ = il.candidate_scores(q, w, pk, sc, bt, cb, q_pos, ratio, backend="xla")
    assert_scores_close(s, s_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,ctx", [(2, 1, 16384), (2, 4, 4096), (1, 2048, 16384)])
def test_gpu_context_flash(B, S, ctx):
    cfg = il.IndexerConfig()
    E, ratio = 64, 2
    G = ctx // ratio
    q, w, pk, sc, bt = make_pool(S, B, S, E=E, pages_per_row=G // E, exact=False)
    gap = 37 if S <= 8 else 1  # a prefill chunk (S = 2048): consecutive positions at the context's end
    q_pos = ctx - 1 - jnp.arange(S, dtype=jnp.int32)[::-1][None] * gap - jnp.arange(B, dtype=jnp.int32)[:, None] * 999
    s = jit(il.context_scores, ratio=ratio, num_entries=G)(q, w, pk, sc, bt, q_pos)
    s_ref = jit(il.context_scores, ratio=ratio, num_entries=G, backend="xla")(q, w, pk, sc, bt, q_pos)
    assert_scores_close(s, s_ref)
    cand = jit(il.candidate_blocks, ratio=ratio, cfg=cfg)(s, q_pos)
    cand_ref = jit(il.candidate_blocks, ratio=ratio, cfg=cfg)(s_ref, q_pos)
    assert np.mean(np.asarray(cand) == np.asarray(cand_ref)) > 0.95


@pytest.mark.gpu
def test_gpu_context_short_rows_in_a_wide_table():
    """Decode rows of 0 to 4K tokens in a 64K-token block table (the engine's one width): the kernel computes only
    each row's tiles up to its context; the scores are the reference's, -inf past each row's visible entries."""
    E, ratio, width = 64, 2, 65536
    G = width // ratio
    q, w, pk, sc, bt = make_pool(5, 4, 1, E=E, pages_per_row=G // E, exact=False)
    q_pos = jnp.asarray([[4095], [1023], [2047], [0]], jnp.int32)
    s = jit(il.context_scores, ratio=ratio, num_entries=G)(q, w, pk, sc, bt, q_pos)
    s_ref = jit(il.context_scores, ratio=ratio, num_entries=G, backend="xla")(q, w, pk, sc, bt, q_pos)
    assert_scores_close(s, s_ref)
    assert np.isneginf(np.asarray(s)[:, :, 2048:]).all()
