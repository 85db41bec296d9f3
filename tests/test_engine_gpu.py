"""The engine on the bench preset (Flash's per-layer widths) with the Mosaic GPU kernels against the XLA path.
GPU only.

Each kernel is checked where its own error can be read: every layer's attention through the KV-path kernels
(prefill chunk and decode step: KV writes, indexer scores + top-k, sparse attention) from the XLA path's state
(tests/layer_paths.py), and the MoE through the grouped FP4 expert GEMM on the same input. The kernels use bf16
scores, bf16 probabilities and a bf16 output where the XLA path keeps float32 sums; the MoE kernel rounds each
expert's output to bf16 before the weighted sum.

The end-to-end run (all kernels, the engine as `dsv41 serve` runs it) is a smoke check with a loose bound: with
random weights a 1% difference in one layer grows chaotically through eight layers (the XLA path's own GPU
scatter-add order moves prefill logits by up to 0.003), and once the first sampled token differs every later
step compares different inputs. FP8 activation quantization is off throughout: with it, a 1e-3 change moves
activations across an FP8 rounding boundary (6% steps)."""

import dataclasses
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_engine

from dsv41 import model, moe, quant
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import preset
from layer_paths import attention_diffs, fill, make_batch, zero_rows
from serving.engine import backends as BK
from serving.engine import kv_pool
from serving.engine.config import EngineConfig, SpeculativeConfig
from serving.engine.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu

NUM = quant.Numerics(act_quant=False, bf16_probs=True, dtype="bfloat16")
# per layer: max |difference| / max |XLA output|. Measured on the H200 (2026-11-30): decode 0.005-0.007; prefill
# 0.013, and 0.031 on the window-only layers, where the chunk's own keys dominate: the kernel reads them as FP8
# (the pool's format) while the XLA path, with activation quantization off, keeps them unrounded (with the
# serving numerics they are FP8 values on both paths).
LAYER_TOL = {"prefill": 5e-2, "decode": 2e-2}
MOE_TOL = 2e-2  # measured 0.005 (1 and 8 tokens), 0 (300 tokens)
# end to end: max |logit difference| / max |logit| at the prefill's last token; measured 0.079 (replay on), where
# the two best tokens are a near tie that flips with either path's rounding (the XLA path itself chose the other
# token before the mHC rounding fix of 2026-11-30)
E2E_TOL = 0.15


@pytest.fixture(scope="module")
def bench():
    cfg = preset("bench")
    return cfg, P.init_params(cfg, seed=0)


@pytest.mark.parametrize("fuse_rope, prefill_indexer, topk, blocks", [
    (False, False, "auto", 0), (True, False, "auto", 0), (False, True, "auto", 0), (True, False, "kernel", 0),
    (True, True, "auto", 1024)], ids=["unfused", "fused-rope", "chunk-indexer", "kernel-topk", "indexer-blocks"])
def test_kv_path_kernels_match_xla_layer_by_layer(bench, fuse_rope, prefill_indexer, topk, blocks):
    """Two rows whose pools hold 1536 tokens (ratio-2 layers: 768 entries, so the top-512 selection is real),
    then a prefill chunk (one ragged row) whose windows reach into the rings, and a decode step; also with the
    query / output RoPE inside the attention kernel or not, with the chunk's indexers through the chunk kernel
    or XLA, over the whole block table or by blocks (of 1024 entries: the ratio-1 candidate source's 2048-entry
    table in two), and with the top-k threshold kernel (`backends.KernelOptions`)."""
    opts = BK.KernelOptions(fuse_rope=fuse_rope, prefill_indexer_kernel=prefill_indexer, indexer_topk=topk,
                            prefill_indexer_block_entries=blocks)
    cfg, params = bench
    core, _ = model.strip_tables(params)
    B, T0, ctx = 2, 1536, 32
    pool = kv_pool.allocate(cfg, kv_pool.PoolLayout(num_pages=B * ctx, page_tokens=64, num_slots=B))
    bt = np.arange(B * ctx).reshape(B, ctx)
    rng = np.random.default_rng(5)
    tokens = rng.integers(3, cfg.vocab_size, (B, T0))
    L = cfg.n_layers
    pool = fill(core, pool, make_batch(tokens, 0, [T0, T0], [0, 1], bt, zero_rows(cfg, B, T0), L), cfg, NUM)
    chunk = rng.integers(3, cfg.vocab_size, (B, 256))
    diffs = {
        "prefill": attention_diffs(core, pool, make_batch(chunk, T0, [256, 200], [0, 1], bt, zero_rows(cfg, B, 256), L),
                                   cfg, NUM, "pallas", opts),
        "decode": attention_diffs(core, pool, make_batch(chunk[:, :1], T0, [1, 1], [0, 1], bt, zero_rows(cfg, B, 1), L),
                                  cfg, NUM, "pallas", opts),
    }
    for k, d in diffs.items():
        print(f"{k} (fused RoPE {fuse_rope}, prefill indexer kernel {prefill_indexer}, blocks {blocks}, top-k {topk}): "
              f"per-layer rel. max difference {np.array2string(d, precision=4)}")
    assert all(np.all(np.isfinite(d)) and d.max() < LAYER_TOL[k] for k, d in diffs.items()), diffs


def test_moe_kernel_matches_xla(bench):
    cfg, params = bench
    ffn = params["layers"][3]["ffn"]
    prepared = BK.prepare_experts({"layers": [params["layers"][3]]})["layers"][0]["ffn"]
    run = jax.jit(functools.partial(moe.moe, cfg=cfg, num=NUM))
    run_k = jax.jit(functools.partial(moe.moe, cfg=cfg, num=NUM, ops=BK.kernel_ops(experts=True)))
    for n in (1, 8, 300):
        x = (jax.random.normal(jax.random.key(n), (n, cfg.dim)) * 2).astype(jnp.bfloat16)
        y, yk = (np.asarray(r(x, p).astype(jnp.float32)) for r, p in ((run, ffn), (run_k, prepared)))
        rel = np.abs(y - yk).max() / np.abs(y).max()
        print(f"moe {n} tokens: rel. max difference {rel:.3g}")
        assert rel < MOE_TOL


def test_fp8_linear_kernel_matches_xla(bench):
    """Every FP8 linear of a layer (the release's e4m3 + UE8M0 32x32), the grouped wo_a too, through the FP8
    linear kernel against the XLA path (dequantize + dot) at decode sizes."""
    from pallas_kernels import fp8_linear

    cfg, params = bench
    lp = params["layers"][2]
    prepared = BK.prepare_linears({"layers": [lp]}, cfg)["layers"][0]
    run = jax.jit(lambda x, w: BK.fp8_linear_op(x, w, NUM, fp8_input=True))
    for path in BK.FP8_LINEARS:
        w, pw = lp, prepared
        for key in path:
            w, pw = (w or {}).get(key), (pw or {}).get(key)
        if not isinstance(pw, fp8_linear.PreparedFp8):
            continue
        for n in (1, 64):
            x = jax.random.normal(jax.random.key(n), (n, w.shape[1])).astype(jnp.bfloat16)
            y, yk = (np.asarray(run(x, v).astype(jnp.float32)) for v in (w, pw))
            rel = np.abs(y - yk).max() / np.abs(y).max()
            print(f"fp8 linear {'.'.join(path)} {w.shape} {n} rows: rel. max difference {rel:.3g}")
            assert rel < 2e-2
    # wo_a: the bf16 tree's FP8 values back in FP8, 8 groups through the same kernel
    w, pw = lp["attn"]["wo_a"], prepared["attn"]["wo_a"]
    assert isinstance(pw, fp8_linear.PreparedFp8) and pw.groups == cfg.o_groups
    grouped = jax.jit(lambda x, w: BK.fp8_grouped_linear_op(x, w, NUM))
    for n in (1, 64):
        x = jax.random.normal(jax.random.key(n), (n, cfg.o_groups, w.shape[1])).astype(jnp.bfloat16)
        y, yk = (np.asarray(grouped(x, v).astype(jnp.float32)) for v in (w, pw))
        rel = np.abs(y - yk).max() / np.abs(y).max()
        print(f"fp8 linear attn.wo_a (grouped) {n} rows: rel. max difference {rel:.3g}")
        assert rel < 2e-2


def test_engine_with_fp8_linear_kernel_end_to_end(bench):
    """The engine with every FP8 linear on the kernel against XLA's dequantize + dot (the other kernels as `auto`
    picks them on both sides). With bf16 K-slice partials this failed on the H200 at the first decode step
    (0.38; docs/KERNELS_EXPERT_GEMM.md, "FP8 linears"); the partials are float32 since."""
    cfg, params = bench
    ids = list(np.random.default_rng(4).integers(3, cfg.vocab_size, 300))
    tx, lx = _run(cfg, params, ids, linear_backend="xla")
    tp, lq = _run(cfg, params, ids, linear_backend="pallas")
    rel = [float(np.abs(lx[i] - lq[i]).max() / np.abs(lx[i]).max()) for i in range(len(lx))]
    print(f"engine, FP8 linear kernel vs XLA: rel. max logit difference per step {np.round(rel, 4).tolist()}; "
          f"tokens {tx} vs {tp}")
    assert np.all(np.isfinite(lq)) and max(rel[:2]) < E2E_TOL  # the prefill and the first decode step


def test_fused_sites_match_xla_in_a_block(bench):
    """One block (layer 3, a stand-in attention) with the fused mHC sites and router against the XLA composition,
    64 and 1 tokens: the stream out and the FFN's pre-mix. The kernels' x may differ from XLA's by an ulp on rare
    elements, which the MoE then carries through its own rounding."""
    cfg, params = bench
    lp = params["layers"][3]
    attn = lambda x, s: ((x.astype(jnp.float32) * 0.5).astype(x.dtype), s)  # noqa: E731
    for t in (64, 1):
        k = jax.random.split(jax.random.key(t), 2)
        h = (jax.random.normal(k[0], (1, t, cfg.hc_mult, cfg.dim)) * 2).astype(jnp.bfloat16)
        pre = jax.nn.softmax(jax.random.normal(k[1], (1, t, cfg.hc_mult)), -1)
        out = {}
        for name, ops in (("xla", BK.kernel_ops()), ("fused", BK.kernel_ops(mhc="pallas", router="pallas"))):
            out[name] = jax.jit(lambda h, pre, lp, o=ops: model.block(h, pre, lp, 3, cfg, NUM, attn, ops=o)[:2])(
                h, pre, lp)
        (hx, px), (hk, pk) = ((np.asarray(a, np.float32), np.asarray(b)) for a, b in (out["xla"], out["fused"]))
        rel = np.abs(hk - hx).max() / np.abs(hx).max()
        print(f"fused sites, {t} tokens: stream rel. max difference {rel:.3g}, pre-mix {np.abs(pk - px).max():.3g}")
        assert rel < MOE_TOL and np.abs(pk - px).max() < 1e-4


# the bench widths on 13 layers with a run of two and a periodic run (the bench preset's own runs are one layer
# each, so scanning them changes nothing): reuse layers 3-4 read KV from layer 2; after the candidate source L5 (the
# split), L6-12 are a reindex layer and two reuse layers, twice, then a reindex layer (a partial period: stacks of
# its own, `layer_runs.Periodic`), as Flash's L21-39
SCANNED_RUNS = dict(n_layers=13, compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1), kv_source_layers=(2, 5),
                    index_source_layers=(2, 5, 6, 9, 12), candidate_source_layer=5, engram_layer_ids=(1,),
                    dspark_target_layer_ids=(10, 11, 12), n_routed_experts=16)


def test_scanned_runs_match_unrolled():
    """The kernels (`auto`) with runs of layers scanned (one compiled body a run, its weights stacked) against
    every layer unrolled: the same kernels on the same inputs, so the logits agree to bf16 rounding (XLA fuses
    the glue between kernels differently inside a loop: on the H200 the logits' largest difference was 0.96-1.08%
    of their largest value (1.4 bf16 ulps of it) after 12 layers with two runs of two; on an H100 with this
    schedule 1.00% and 1.12%), and the greedy tokens are the same until a step where the two nearly tie (on that
    H100 the first decode step's top two logits were 0.05% and 0.41% of the largest apart, so the programs picked
    differently and the steps after it saw different tokens). What must hold before `backends.scans_layers` scans
    where kernels run."""
    cfg = preset("bench").replace(**SCANNED_RUNS)
    params = P.init_params(cfg, seed=0)
    ids = list(np.random.default_rng(5).integers(3, cfg.vocab_size, 300))
    tu, lu = _run(cfg, params, ids, scan_layers=False)
    ts, ls = _run(cfg, params, ids, scan_layers=True)
    # the steps up to the first greedy token that differs see the same inputs; a token may differ only where the
    # two programs' logits nearly tie on it (the bench preset's random-weight logits are flat)
    k = next((i for i in range(len(tu)) if tu[i] != ts[i]), len(tu) - 1)
    rel = [float(np.abs(lu[i] - ls[i]).max() / np.abs(lu[i]).max()) for i in range(k + 1)]
    gap = [float((lo[k][a] - lo[k][b]) / np.abs(lo[k]).max()) for lo, a, b in ((lu, tu[k], ts[k]), (ls, ts[k], tu[k]))]
    print(f"scanned vs unrolled, kernels auto: rel. max logit difference per step {np.round(rel, 5).tolist()}; "
          f"tokens {tu} vs {ts}; at step {k} each one's top logit over the other's token {np.round(gap, 5).tolist()}")
    assert np.all(np.isfinite(ls)) and max(rel) < 2e-2 and max(gap) < 2e-2


def _run(cfg, params, ids, **kw):
    eng = Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg),
                 config=EngineConfig(max_num_seqs=1, max_model_len=2048,
                 max_num_batched_tokens=2048, enable_prefix_caching=False, numerics=NUM, keep_logits=True,
                 min_prefill_bucket=2048, **kw))
    toks = []
    eng.add_request("r", ids, SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_work():
        for o in eng.step():
            toks += o.new_token_ids
    return toks, np.stack(eng.finished_logits["r"]).astype(np.float32)


_XLA_RUNS: dict = {}


@pytest.mark.parametrize("replay, sites", [(True, "auto"), (True, "pallas"), (False, "auto")])
def test_engine_with_all_kernels_end_to_end(bench, replay, sites):
    """The XLA path against `auto` (what `dsv41 serve` picks on a GPU), and with the opt-in fused mHC and router
    sites."""
    cfg, params = bench
    ids = list(np.random.default_rng(3).integers(3, cfg.vocab_size, 1500))
    if replay not in _XLA_RUNS:  # shared by the parameter sets with the same replay mode (a run is ~80 s)
        _XLA_RUNS[replay] = _run(cfg, params, ids, swa_bounded_replay=replay, attention_backend="xla",
                                 moe_backend="xla", mhc_backend="xla", router_backend="xla")
    tx, lx = _XLA_RUNS[replay]
    tp, lp = _run(cfg, params, ids, swa_bounded_replay=replay, attention_backend="auto", moe_backend="auto",
                  mhc_backend=sites, router_backend=sites)
    rel = [float(np.abs(lx[i] - lp[i]).max() / np.abs(lx[i]).max()) for i in range(len(lx))]
    same = next((i for i, (a, b) in enumerate(zip(tx, tp)) if a != b), len(tx))
    print(f"replay={replay} sites={sites}: rel. max logit difference per step {np.round(rel, 4).tolist()} (inputs "
          f"equal for the first {same + 1}); tokens {tx} vs {tp}")
    assert np.all(np.isfinite(lp)) and rel[0] < E2E_TOL


def _small_engine(cfg, params, **kw) -> Engine:
    """An engine of 4 sequences of up to 2048 tokens, 512-token chunks from a 128-token bucket, no prefix cache,
    the logits kept; kw: other EngineConfig fields."""
    return Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg),
                  config=EngineConfig(max_num_seqs=4, max_model_len=2048, max_num_batched_tokens=512,
                                      enable_prefix_caching=False, numerics=NUM, keep_logits=True,
                                      min_prefill_bucket=128, min_decode_bucket=4, **kw))


def test_shared_prefill_call_with_the_kernels(bench):
    """Short prompts in one prefill call of the shared shape (`--max-prefill-rows`: 4 rows x 128 tokens, exact
    prefill) through the kernels (`auto`) against each prompt in a call of its own: the same kernels on the same
    rows, the other rows padding, so the first tokens' logits agree to the kernels' rounding (checked as loosely as
    the end-to-end runs: random weights amplify a rounding through eight layers). What must hold before
    `max_prefill_rows` > 1 becomes a GPU default."""
    cfg, params = bench
    prompts = [list(np.random.default_rng(40 + i).integers(3, cfg.vocab_size, n)) for i, n in enumerate((100, 70, 120))]

    def first_logits(rows):
        eng = _small_engine(cfg, params, swa_bounded_replay=False, max_prefill_rows=rows)
        for i, p in enumerate(prompts):
            eng.add_request(f"p{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
        while eng.has_work():
            eng.step()
        return eng.counters["prefill_calls"], [np.asarray(eng.finished_logits[f"p{i}"][0], np.float32)
                                               for i in range(len(prompts))]

    calls, shared = first_logits(4)
    alone_calls, alone = first_logits(1)
    rel = [float(np.abs(a - s).max() / np.abs(a).max()) for a, s in zip(alone, shared)]
    print(f"shared prefill call: {calls} call(s) against {alone_calls}; rel. max logit difference {np.round(rel, 4)}")
    assert calls == 1 and alone_calls == len(prompts)
    assert all(np.all(np.isfinite(s)) for s in shared) and max(rel) < E2E_TOL


def test_fed_engine_gives_the_synchronous_tokens(bench):
    """Decode tokens fed on the device (a GPU's default: `EngineConfig.feeds_on_device`) through the kernels
    (`auto`) against the same engine reading them on the host: three requests of different lengths, admitted while
    others decode, greedy; the same tokens, and the logits of every step equal up to the rounding of programs
    compiled apart (the fed decode program gathers the Engram rows from device tables: the same bytes)."""
    cfg, params = bench
    prompts = [list(np.random.default_rng(50 + i).integers(3, cfg.vocab_size, n)) for i, n in enumerate((300, 40, 700))]

    def run(feed):
        eng = _small_engine(cfg, params, device_feed=feed)
        assert eng.device_feed == feed
        return _greedy_run(eng, prompts, 6)

    assert EngineConfig().feeds_on_device(jax.default_backend())
    (fed, fed_logits), (host, host_logits) = run(True), run(False)
    rel = {r: float(np.abs(fed_logits[r] - host_logits[r]).max() / np.abs(host_logits[r]).max()) for r in host}
    print(f"fed against read on the host: tokens {fed} / {host}; rel. max logit difference {rel}")
    assert fed == host and max(rel.values()) < 1e-3


def _greedy_run(eng: Engine, prompts: list, max_tokens: int, more: dict | None = None) -> tuple[dict, dict]:
    """prompts added at once ("p0", "p1", ...; prompt i decodes max_tokens + i tokens, greedy), with `more`
    ({id: (prompt, SamplingParams)}), and run to the end. -> (tokens, logits float32 [steps, V]) by request."""
    toks, _ = tiny_engine.drain(eng, {**{f"p{i}": (p, SamplingParams(max_tokens=max_tokens + i, ignore_eos=True))
                                         for i, p in enumerate(prompts)}, **(more or {})})
    return toks, {r: np.stack(v).astype(np.float32) for r, v in eng.finished_logits.items()}


@pytest.mark.parametrize("greedy_program", [False, True], ids=["sampling_program", "greedy_program"])
def test_fed_speculative_engine_gives_the_synchronous_tokens(bench, greedy_program):
    """DSpark (k = 5, the bench preset's three stages at Flash's widths) with each step's chunk built on the device
    from the step in flight (`--device-feed`: `programs.SpecFeed`), split at the split layer as a GPU runs it,
    through the kernels, against the same engine reading each step on the host. Forced acceptance with a confidence
    cut at 0.5: each row accepts the drafts its cut kept, so accept lengths, anchor parities and Engram history
    shifts vary by row and step. A seeded sampled request ends first, so later steps are all greedy. The same
    tokens, and the logits equal up to the rounding of programs compiled apart; fed with the sampling branch on
    the device (`lax.switch`) or the host's (`greedy_program`: the all-greedy program, or the one filtering every
    row while the sampled request runs; no host round trip), against the switch read on the host."""
    cfg, _ = bench
    cfg = cfg.replace(n_mtp_layers=3)
    params = P.init_params(cfg, seed=0)
    prompts = [list(np.random.default_rng(60 + i).integers(3, cfg.vocab_size, n)) for i, n in enumerate((301, 40))]
    spec = SpeculativeConfig(num_speculative_tokens=5, forced_acceptance=True, confidence_threshold=0.5)

    def run(feed, greedy_program):
        gc.collect()  # the last engine's pool and programs: two bench-size engines at once do not fit an H100
        eng = _small_engine(cfg, params, device_feed=feed,
                            speculative_config=dataclasses.replace(spec, greedy_program=greedy_program))
        assert eng.device_feed == feed and len(eng.decode_kinds) == 2
        sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
        return *_greedy_run(eng, prompts, 20, {"s": (prompts[1][:25], sampled)}), eng.stats()

    host, host_logits, _ = run(False, False)
    fed, fed_logits, st = run(True, greedy_program)
    rel = {r: float(np.abs(fed_logits[r] - host_logits[r]).max() / np.abs(host_logits[r]).max()) for r in host}
    print(f"fed speculative against read on the host: tokens {fed} / {host}; rel. max logit difference {rel}; "
          f"verified per length {st['spec_verified_per_len']}")
    assert fed == host and max(rel.values()) < 1e-3


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 or more GPUs (expert parallelism)")
def test_ragged_expert_exchange_on_the_gpus():
    """`--all2all-backend ragged_all_to_all` through XLA's collective (the CPU tests run its all-gather form) on a
    DEP mesh of the machine's GPUs (2, 4 or 8), at 10 and 1 tokens a rank: the same sums as the default exchange
    (float32, another order) and as the plain MoE on one device."""
    import dataclasses

    from dsv41 import sharding
    from dsv41.ops import XLA

    cfg, params = tiny_engine.tiny()
    n = max(d for d in (2, 4, 8) if d <= len(jax.devices()))
    par = sharding.Parallelism(data=n, expert=True)
    mesh = sharding.make_mesh(par)
    p = sharding.place_params(params, cfg, par, mesh)["layers"][3]["ffn"]
    specs = jax.tree_util.tree_map(lambda a: sharding.manual_spec(a.sharding), p)
    R = sharding.rank_sharding(mesh).spec

    def program(exchange):
        ep = sharding.ExpertParallel(moe.routed_experts, 1, exchange)  # the collective itself
        ops = dataclasses.replace(XLA, routed_experts=ep)
        return jax.jit(jax.shard_map(lambda p, x: moe.moe(x, p, cfg, tiny_engine.NUM, ops=ops), mesh=mesh,
                                     in_specs=(specs, R), out_specs=R, axis_names={sharding.DATA}))

    for T in (10, 1):
        x = np.random.default_rng(T).standard_normal((n, T, cfg.dim)).astype(np.float32)
        want = np.asarray(moe.moe(x, params["layers"][3]["ffn"], cfg, tiny_engine.NUM))
        ragged = np.asarray(program("ragged_all_to_all")(p, x))
        gathered = np.asarray(program("allgather_reducescatter")(p, x))
        scale = np.abs(want).max()
        d_gathered, d_one = np.abs(ragged - gathered).max() / scale, np.abs(ragged - want).max() / scale
        print(f"ragged exchange on {n} GPUs, {T} tokens a rank: max |difference| / max |output| against the "
              f"all-gather exchange {d_gathered:.2e}, against one device {d_one:.2e}")
        assert d_gathered <= 1e-5 and d_one <= 1e-3
