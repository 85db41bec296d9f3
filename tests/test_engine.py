"""The engine against the exact full-sequence model, bounded replay against exact, prefix hits against a cold
run with the same replay semantics. float32 activations with the serving formats' KV numerics on both sides,
so differences are summation order only (bf16 runs diverge chaotically through FP8 bins, see docs/REPLAY.md)."""

import jax
import numpy as np
import pytest
import tiny_engine

from dsv41 import model, quant
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import preset
from serving.engine import kv_pool, programs
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine, EngineError, SamplingParams
from tiny_engine import NUM

# one xdist worker takes this file (and the other tests that run a tiny engine): its engines share the same few
# compiled programs, which two workers would each compile
pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)

TOL = 1e-4  # max |logit| difference; logits are O(1)
# The engine against the full-sequence model (`model.forward`): the two sum in different orders, and a value a few
# ulps from an FP8 bin edge rounds to the other bin on one side. On an AVX-512 CPU (AMD EPYC, 2026-12-02) under the
# suite's XLA -O0 the full-sequence program's layer-4 input differs by 2.7e-6 from -O3's, enough to move two FP8
# entries of that layer's SWA KV (positions 120 and 184) by a bin: 1.3e-3 on the attention of queries 120-199,
# 3.9e-4 on the logits (-O1 to -O3 and the engine agree to 3e-6). A wrong position or mask moves logits by O(0.1).
TOL_FORWARD = 1e-3
GREEDY4 = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_engine.tiny()


def make(tiny, **kw):
    """The shared tiny engine (`tiny_engine.make`, whose parameters are the `tiny` fixture's) with `kw` changed."""
    return tiny_engine.make(**kw)


def run(eng, prompt, sampling=GREEDY4, **kw):
    rid = f"r{len(eng.finished_logits)}"
    eng.add_request(rid, prompt, sampling, **kw)
    toks = []
    while eng.has_work():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.new_token_ids
    return toks, np.stack(eng.finished_logits[rid])


def prompt(n, seed=0):
    return list(np.random.default_rng(seed).integers(3, 1000, n))


def test_exact_engine_equals_forward(tiny):
    cfg, params = tiny
    eng = make(tiny, swa_bounded_replay=False)
    ids = prompt(200)  # two prefill chunks, past the window, an odd decode position completes a ratio-2 group
    toks, logits = run(eng, ids)
    full = np.asarray(model.forward(params, cfg, np.asarray([ids + toks[:-1]]), NUM))[0, len(ids) - 1:]
    assert np.abs(logits - full).max() < TOL_FORWARD
    assert toks == list(full.argmax(-1))


def test_short_prompts_identical_with_replay(tiny):
    ids = prompt(100, seed=1)
    t_exact, l_exact = run(make(tiny, swa_bounded_replay=False), ids)
    t_rep, l_rep = run(make(tiny, swa_bounded_replay=True, enable_prefix_caching=False), ids)
    assert t_exact == t_rep
    assert np.abs(l_exact - l_rep).max() < TOL


def test_long_prompt_replay_is_close_not_exact(tiny):
    ids = prompt(256, seed=2)
    _, l_exact = run(make(tiny, swa_bounded_replay=False), ids, SamplingParams(max_tokens=1))
    _, l_rep = run(make(tiny, swa_bounded_replay=True, enable_prefix_caching=False), ids, SamplingParams(max_tokens=1))
    d = np.abs(l_exact - l_rep).max()
    assert 1e-4 < d < 5.0  # replay changes the decoder's windows: a real, bounded difference


def test_prefix_hit_equals_cold_replay(tiny):
    first, second = prompt(200, seed=3), prompt(60, seed=4)
    eng = make(tiny, swa_bounded_replay=True, enable_prefix_caching=True)
    run(eng, first, SamplingParams(max_tokens=1))
    toks, logits = run(eng, first + second)
    st = eng.stats()
    assert st["prefix_cache_hit_tokens"] == 192  # 3 full pages of 64
    cold_t, cold_l = run(make(tiny, swa_bounded_replay=True, enable_prefix_caching=False), first + second,
                         replay_at=192)
    assert toks == cold_t and np.abs(logits - cold_l).max() < TOL


def test_replay_tokens_at_the_window_reproduce_window_replay(tiny):
    """swa_replay_tokens = window is the replay the engine ran before the option existed: tokens and logits
    recorded from that engine (under the suite's XLA -O0) for a prompt whose decoder windows are clipped. XLA:CPU's
    code differs by optimization level and by host CPU (-O3, or -O0 on an AMD EPYC host) and flips FP8 bins, which
    moves these logits by up to 2.4e-3; the exact path's are 1.8e-2 away, so 5e-3 still tells the two apart."""
    toks, logits = run(make(tiny, swa_bounded_replay=True, enable_prefix_caching=False, swa_replay_tokens=128),
                       prompt(300, seed=30))
    assert toks == [906, 509, 403, 309]
    assert np.abs(logits[0, :4] - [-0.42925271, 1.25267196, 1.77353561, -0.70392036]).max() < 5e-3


# prompts of up to 4 windows, a decoder prefill of up to 2: one prefill width and block-table width for the test below
WIDE = dict(max_model_len=640, num_pages=10, max_num_batched_tokens=256, min_prefill_bucket=256)


def test_prefix_hit_equals_cold_replay_with_more_replay_tokens(tiny):
    """With swa_replay_tokens = 2 windows a hit of H tokens re-runs the encoder from H - 256 (not H - window),
    so that the decoder gets its 256 rows: exactly what a cold run with that boundary gives."""
    first, second, one = prompt(400, seed=32), prompt(60, seed=33), SamplingParams(max_tokens=1)
    eng = make(tiny, swa_bounded_replay=True, enable_prefix_caching=True, swa_replay_tokens=256, **WIDE)
    run(eng, first, one)
    _, logits = run(eng, first + second, one)
    assert eng.stats()["prefix_cache_hit_tokens"] == 384  # 6 full pages of 64
    _, cold = run(make(tiny, swa_bounded_replay=True, enable_prefix_caching=False, swa_replay_tokens=256, **WIDE),
                  first + second, one, replay_at=384)
    assert np.abs(logits - cold).max() < TOL


def test_replay_tokens_bounds():
    with pytest.raises(EngineError, match="swa_replay_tokens=600 exceeds max_num_batched_tokens=512"):
        EngineConfig(swa_replay_tokens=600)
    with pytest.raises(EngineError, match="below the model's window"):
        tiny_engine.make(swa_replay_tokens=64)


def test_program_shapes_cover_the_buckets(tiny):
    """What warm-up compiles: every prefill chunk bucket and every decode batch bucket, each with the one
    block-table width (max_model_len's pages: the context length is a run-time value), and the short prompts'
    shared call (3 rows of 32 tokens: 3 sequences, at most 128 tokens) with its decoder; with `split_decode` (a
    GPU's default) a decode step is two programs, cut at the split layer."""
    def decode(*Bs):
        return [(k, B, 1, 8) for B in Bs for k in ("decode_first", "decode_rest")]

    eng = make(tiny, swa_bounded_replay=True, max_num_seqs=3, min_prefill_bucket=32, min_decode_bucket=1,
               max_prefill_rows=4, split_decode=True)
    shapes = eng.program_shapes()
    c = 8  # 512 tokens / 64 per page
    assert shapes == ([("encoder", 1, T, c) for T in (32, 64, 128)] + [("encoder", 3, 32, c)]
                      + [("decoder", 1, 1, c), ("decoder", 3, 1, c)] + decode(1, 2, 4))
    one = make(tiny, swa_bounded_replay=True, max_num_seqs=3, min_prefill_bucket=32, min_decode_bucket=1)
    assert [s for s in one.program_shapes() if s[0] != "decode"] == (
        [("encoder", 1, T, c) for T in (32, 64, 128)] + [("decoder", 1, 1, c)])
    exact = make(tiny, swa_bounded_replay=False, min_prefill_bucket=128, min_decode_bucket=1, split_decode=True)
    assert exact.program_shapes() == [("full", 1, 128, 8)] + decode(1, 2)
    # min_decode_bucket: a lone sequence's decode step pads to that many rows, one program fewer (the CPU's default:
    # the decode step as one program)
    assert make(tiny, swa_bounded_replay=False, min_prefill_bucket=128,
                min_decode_bucket=2).program_shapes() == [("full", 1, 128, 8), ("decode", 2, 1, 8)]


def short_prompts():
    return {"a": prompt(40, seed=11), "b": prompt(57, seed=12)}


def serve_together(eng, ps):
    """The prompts ps (id -> tokens) admitted together, stepped to the end -> (tokens by id, logits [tokens, V] by
    id)."""
    for rid, p in ps.items():
        eng.add_request(rid, p, GREEDY4)
    toks = {}
    while eng.has_work():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    return toks, {rid: np.stack(eng.finished_logits.pop(rid)) for rid in ps}


def test_short_prompts_share_one_prefill_call(tiny):
    """Two short prompts admitted together run in one prefill call of the shared shape (2 rows x 64 tokens) and one
    replay decoder call of 2 rows; each gets the tokens and logits it gets alone (a call a prompt at the 128-token
    bucket: float32 summation orders may differ with the shapes, 1e-5)."""
    eng = make(tiny, min_prefill_bucket=64, max_prefill_rows=4)
    assert eng.shared_prefill == (2, 64)  # 2 rows: max_num_seqs
    ps = short_prompts()
    toks, together = serve_together(eng, ps)
    assert eng.counters["prefill_calls"] == 1
    alone = make(tiny)
    for rid, p in ps.items():
        t, logits = run(alone, p)
        assert toks[rid] == t
        np.testing.assert_allclose(together[rid], logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lengths, want", [
    ((40, 30), [40, 30]),  # both finish in one shared call
    ((200, 40), [64, 40]),  # the oldest goes on with 64 tokens, the short one finishes beside it
    ((40, 70), None),  # the second needs more than a row: one call a prompt
    ((200, 300), None),
])
def test_shared_call_takes_the_prompts_it_can_finish_behind_the_oldest(tiny, lengths, want):
    eng = make(tiny, min_prefill_bucket=64, num_pages=12, max_prefill_rows=2)
    for i, n in enumerate(lengths):
        eng.add_request(f"p{i}", prompt(n, seed=i), GREEDY4)
    eng._admit()
    picks = eng._shared_picks({0: sorted(eng.running.values(), key=lambda r: r.arrival)})
    assert (None if picks is None else [end - r.computed for r, end in picks]) == want
    if picks:
        assert [r.id for r, _ in picks] == ["p0", "p1"]


def test_warmup_leaves_nothing_to_compile(tiny):
    """After `Engine.warmup()` a request compiles nothing: two prefill chunks, the replay decoder and decode steps
    call the programs warm-up ran, with the same argument signatures (a jitted call compiles per shape and per
    committed / uncommitted argument: warm-up's all-padding arguments must be what a step passes). The lone
    request's decode steps pad to the tests' min_decode_bucket of 2 rows, the only decode width warm-up ran. A
    request of one page and one of four run the same programs (the block table is always max_model_len wide)."""
    eng = make(tiny)
    eng.warmup()
    progs = (programs.run_full, programs.run_encoder, programs.run_decoder)
    before = [p._cache_size() for p in progs]
    for n in (200, 20):
        toks, _ = run(eng, prompt(n, seed=8))
        assert len(toks) == 4
    assert [p._cache_size() for p in progs] == before


def test_staged_warmup_pads_to_the_covering_programs_until_the_rest_arrive(tiny):
    """`warmup(staged=True)` returns once the covering programs are ready (the 128-token encoder, the one-row
    decoder, the 2-row decode step's two programs: `split_decode`, a GPU's default): until the others arrive, two
    short prompts run one call each at 128 tokens instead of the shared 2 x 64 call, with the tokens and logits of
    an engine that has only those programs and runs its decode step as one (bit for bit). Once every program is in
    use the shared call runs; nothing compiles on a request's path either way."""
    eng = make(tiny, min_prefill_bucket=64, max_prefill_rows=4, split_decode=True)
    c = 8
    assert eng.warmup(staged=True) == eng.covering_shapes() == [("encoder", 1, 128, c), ("decoder", 1, 1, c),
                                                                ("decode_first", 2, 1, c), ("decode_rest", 2, 1, c)]
    assert not eng.warmup_progress.done and eng.warmup_progress.snapshot()["programs_ready"] == 4
    assert (eng.stats()["warmup_programs_ready"], eng.stats()["warmup_programs"]) == (4, 7)  # /metrics' gauges
    # min_prefill_bucket 128: the covering programs only (compiled through jit)
    want = serve_together(make(tiny), short_prompts())
    progs = (programs.run_full, programs.run_encoder, programs.run_decoder, programs.ONE_DEVICE.run_decode_first,
             programs.ONE_DEVICE.run_decode_rest)
    compiled = [p._cache_size() for p in progs]
    held, eng._background = eng._background, None  # the background's programs wait: steps use the covering ones
    toks, logits = serve_together(eng, short_prompts())
    assert eng.counters["prefill_calls"] == 2
    assert toks == want[0] and all((logits[k] == want[1][k]).all() for k in logits)

    eng._background = held
    assert eng.wait_for_programs(timeout_s=300) and eng.warmup_progress.done
    assert eng.stats()["warmup_programs_ready"] == 7
    toks2, logits2 = serve_together(eng, short_prompts())
    assert eng.counters["prefill_calls"] == 3  # one shared call
    assert toks2 == toks and all(np.allclose(logits2[k], logits[k], rtol=0, atol=1e-5) for k in logits)
    assert [p._cache_size() for p in progs] == compiled


def test_concurrent_requests_and_back_pressure(tiny):
    eng = make(tiny, swa_bounded_replay=False)  # 5 pages, room for 320 tokens: forces a preemption
    a, b = prompt(180, seed=5), prompt(150, seed=6)
    eng.add_request("a", a, GREEDY4)
    eng.add_request("b", b, GREEDY4)
    outs = {"a": [], "b": []}
    while eng.has_work():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    assert len(outs["a"]) == 4 and len(outs["b"]) == 4
    assert eng.stats()["preemptions"] >= 1 and eng.stats()["kv_pages_used"] == 0
    alone, _ = run(make(tiny, swa_bounded_replay=False), b)
    assert outs["b"] == alone


def test_sampling_is_seeded(tiny):
    eng = make(tiny, swa_bounded_replay=False)
    ids = prompt(20, seed=7)
    s = SamplingParams(max_tokens=4, temperature=1.5, top_p=0.9, top_k=50, seed=11, ignore_eos=True)
    assert run(eng, ids, s)[0] == run(eng, ids, s)[0]
    assert run(eng, ids, SamplingParams(max_tokens=4, temperature=5.0, top_k=1, ignore_eos=True))[0] == run(eng, ids)[0]


def _sampling(temps, top_p, top_k, seed=0):
    import jax.numpy as jnp

    from serving.engine.programs import Sampling
    B = len(temps)
    keys = np.stack([np.array([seed, i], np.uint32) for i in range(B)])
    return Sampling(jnp.asarray(temps, jnp.float32), jnp.asarray(top_p, jnp.float32),
                    jnp.asarray(top_k, jnp.int32), jnp.asarray(keys))


def test_sample_branches():
    """Greedy rows, plain draws and top-k / top-p filtered draws, alone and mixed in one batch (the filters are
    skipped when no row needs them: the result may not depend on which rows share the batch)."""
    import functools

    import jax

    from serving.engine.programs import sample
    rng = np.random.default_rng(0)
    logits = jax.numpy.asarray(rng.standard_normal((4, 300)) * 3, jax.numpy.float32)
    greedy = np.asarray(logits).argmax(-1)
    f = jax.jit(functools.partial(sample, filtered=True))  # the filter leaves rows that do not filter as they are
    assert (np.asarray(f(logits, _sampling([0, 0, 0, 0], [1] * 4, [0] * 4))) == greedy).all()
    # top_k=1 and a tiny top_p leave only the argmax, at any temperature
    out = np.asarray(f(logits, _sampling([0, 5.0, 5.0, 0], [1, 1, 1e-6, 1], [0, 1, 0, 0])))
    assert (out == greedy).all()
    # a plain draw at a high temperature differs from the argmax somewhere; it is the same draw whether or not
    # another row of the batch is filtered, and top_k=3 keeps a row's draws inside its 3 largest logits
    plain = np.asarray(f(logits, _sampling([50.0] * 4, [1] * 4, [0] * 4)))
    assert (plain != greedy).any()
    mixed = np.asarray(f(logits, _sampling([50.0, 50.0, 50.0, 50.0], [1, 1, 1, 1], [0, 3, 0, 0])))
    assert mixed[0] == plain[0] and mixed[2] == plain[2]
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    for seed in range(8):
        out = np.asarray(f(logits, _sampling([50.0] * 4, [1] * 4, [3] * 4, seed)))
        assert all(out[i] in top3[i] for i in range(4))
    # the engine's sampling program: the variant the host chose (`Engine._drawn`) draws what the filter always would
    g = jax.jit(sample, static_argnames="filtered")
    for t, p, k in [([0, 5.0, 5.0, 0], [1, 1, 1e-6, 1], [0, 1, 0, 0]), ([50.0] * 4, [1] * 4, [0] * 4),
                    ([50.0, 0, 50.0, 50.0], [1, 1, 0.5, 1], [0, 3, 0, 0])]:
        s = _sampling(t, p, k, seed=3)
        filtered = any(ti > 0 and (ki > 0 or pi < 1) for ti, pi, ki in zip(t, p, k))
        assert (np.asarray(g(logits, s, filtered=filtered)) == np.asarray(f(logits, s))).all()


@pytest.mark.parametrize("kw, msg", [
    (dict(mhc_backend="pallas"), "needs a CUDA GPU"),  # this CPU
    (dict(router_backend="interpret"), "n_routed_experts a multiple of 64"),  # tiny: 8 experts
    (dict(mhc_backend="interpret", numerics=quant.EXACT_F32), "bfloat16"),
    (dict(mhc_backend="fast"), "one of"),
    (dict(attention_backend="pallas"), "needs a CUDA GPU"),
    (dict(linear_backend="pallas"), "needs a CUDA GPU"),
    (dict(linear_backend="interpret"), "needs FP8 linear weights"),  # tiny here: dequantized to float32
    (dict(linear_backend="fp8"), "one of"),
])
def test_kernel_backends_that_cannot_run_say_why(tiny, kw, msg):
    cfg, params = tiny
    with pytest.raises(EngineError, match=msg):
        Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg), config=EngineConfig(**kw))


def test_engram_tables_mode_is_checked_before_loading():
    with pytest.raises(EngineError, match="engram_tables='disk'"):
        Engine.from_checkpoint("/nonexistent", engram_tables="disk")


def test_auto_backends(tiny, monkeypatch):
    """'auto' on a GPU: the mHC and router kernels where their shapes allow, each up to its measured token limit
    (tiny: dim 256 and bf16 take the mHC kernel; 8 experts do not take the router's), the FP8 linear kernel where
    the linears are FP8 and the activations bf16; everything on XLA on a CPU."""
    import dataclasses

    from dsv41 import mhc, moe
    from serving.engine import backends as E
    cfg, params = tiny
    release = P.init_params(cfg, seed=0)  # FP8 linears, as a checkpoint holds them
    assert E.resolve_backends(cfg, params, "auto", "auto")[2:] == (mhc.site, moe.route_plain)
    assert E.resolve_linear_backend(release, "auto", quant.REFERENCE) == "xla"
    monkeypatch.setattr(E.jax, "default_backend", lambda: "gpu")
    assert E.resolve_linear_backend(release, "auto", quant.REFERENCE) == "pallas"
    assert E.resolve_linear_backend(release, "auto", quant.EXACT_F32) == "xla"
    assert E.resolve_linear_backend(params, "auto", quant.REFERENCE) == "xla"  # dequantized: no FP8 linears
    assert E.resolve_linear_backend(release, "xla", quant.REFERENCE) == "xla"
    sites = E.resolve_backends(cfg, params, "auto", "auto", num=quant.REFERENCE)[2:]
    assert sites == (E.FusedMhcSite("pallas", E.SITE_KERNEL_MAX_TOKENS["mhc"]), moe.route_plain)
    assert E.resolve_backends(cfg, params, "auto", "auto", mhc_backend="pallas")[2].max_tokens is None
    assert E.resolve_backends(cfg, params, "auto", "auto", num=quant.EXACT_F32)[2] == mhc.site
    wide = dataclasses.replace(cfg, n_routed_experts=64)
    route = E.resolve_backends(wide, params, "auto", "auto")[3]
    assert route == E.FusedRoute("pallas", E.SITE_KERNEL_MAX_TOKENS["router"])
    assert E.resolve_backends(wide, params, "auto", "auto", router_backend="xla")[3] == moe.route_plain


@pytest.mark.parametrize("kw, sampling, msg", [
    (dict(prompt_ids=list(range(3, 600))), SamplingParams(), "max_model_len"),
    (dict(prompt_ids=[]), SamplingParams(), "empty"),
    (dict(prompt_ids=[1, 2000]), SamplingParams(), "vocabulary"),
    (dict(prompt_ids=[1, 2]), SamplingParams(max_tokens=0), "max_tokens"),
    (dict(prompt_ids=[1, 2]), SamplingParams(top_p=0.0), "top_p"),
    (dict(prompt_ids=[1, 2]), SamplingParams(top_k=-1), "top_k"),
    (dict(prompt_ids=[1, 2]), SamplingParams(top_k=2.5), "top_k"),
])
def test_bad_requests(tiny, kw, sampling, msg):
    with pytest.raises(EngineError, match=msg):
        make(tiny).add_request("x", kw["prompt_ids"], sampling)


@pytest.mark.parametrize("kw, msg", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(page_tokens=63), "even"),
    (dict(min_decode_bucket=0), "min_decode_bucket"),
    (dict(max_waiting=-1), "max_waiting"),
])
def test_engine_config_rejects_bad_values(kw, msg):
    with pytest.raises(EngineError, match=msg):
        EngineConfig(**kw)


def test_engine_takes_only_an_engine_config(tiny):
    cfg, params = tiny
    with pytest.raises(EngineError, match="EngineConfig"):
        Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg), dict(max_num_seqs=2))


def test_waiting_request_ids_oldest_first(tiny):
    eng = make(tiny)
    for rid in ("a", "b", "c"):
        eng.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=1))
    assert eng.waiting_request_ids() == ["a", "b", "c"]
    eng.abort("b")
    assert eng.waiting_request_ids() == ["a", "c"]


def test_a_huge_top_k_keeps_every_token(tiny):
    """top_k at or past the vocabulary means 'off', as 0 does, and fits the int32 row."""
    from serving.engine.sampling import sampling_arrays

    eng = make(tiny)
    eng.add_request("k", [1, 2, 3], SamplingParams(top_k=2 ** 63))
    eng.add_request("j", [1, 2, 3], SamplingParams(top_k=5))
    s = sampling_arrays(list(eng.waiting) + [None, None], eng.cfg.vocab_size, eng._fail)
    assert np.asarray(s.top_k).tolist() == [0, 5, 0, 0]


def test_flash_pool_is_890_bytes_per_token():
    cfg = preset("flash")
    lay = kv_pool.PoolLayout(num_pages=1000, page_tokens=64, num_slots=4)
    assert kv_pool.global_bytes_per_token(cfg, lay) == 890.0
    a = kv_pool.abstract_pool(cfg, lay)  # shapes only: nothing is allocated
    src2, src20 = a.of_layer(cfg, 2), a.of_layer(cfg, 20)
    assert src2.kv_packed.shape == (1000, 32, 256) and src20.kv_scale.shape == (1000, 64, 32)
    assert src2.ik_packed.shape[-1] + src2.ik_scale.shape[-1] == 68
    assert a.runs[0].swa_q.shape[-1] + a.runs[0].swa_s.shape[-1] == 528


def test_request_views_match_the_whole_sequence():
    """The per-step views of a request (no O(context) list per step) against the whole sequence."""
    from serving.engine.engine import _Request

    r = _Request("r", list(range(10)), SamplingParams(), None, 0.0)
    r.output = [100, 101, 102]
    seq = r.prompt + r.output
    assert r.num_tokens == len(seq) and r.last_token == seq[-1] == 102
    for lo, hi in [(0, 13), (0, 10), (3, 7), (8, 12), (10, 13), (11, 12), (0, 0), (12, 20)]:
        assert r.token_range(lo, hi) == seq[lo:hi], (lo, hi)
    assert _Request("p", [5], SamplingParams(), None, 0.0).last_token == 5
    r.pages = [3, 1]
    np.testing.assert_array_equal(r.page_row(), [3, 1])
    r.pages.append(7)  # appended in place: the row follows
    np.testing.assert_array_equal(r.page_row(), [3, 1, 7])
    r.pages = [9, 9, 9]  # replaced by a list of the same length (a re-admission): the row follows too
    np.testing.assert_array_equal(r.page_row(), [9, 9, 9])


def test_prefix_keys_chain_and_are_hashed_once(tiny, monkeypatch):
    """Keys continued from a page's key equal the keys hashed in one go; a request hashes each page once
    (admission, then finish), however long its conversation."""
    from serving.engine.engine import PrefixCache

    pc = PrefixCache(4)
    toks = list(range(3, 40))
    whole = pc.keys(toks)
    assert len(whole) == 9 and pc.keys(toks[:12]) + pc.keys(toks[12:], pc.keys(toks[:12])[-1]) == whole
    hashed = []
    real = PrefixCache.keys
    monkeypatch.setattr(PrefixCache, "keys", lambda self, t, prev=b"", salts=(): hashed.append(len(t))
                        or real(self, t, prev, salts))
    eng = make(tiny)
    ids = prompt(190, seed=3)
    run(eng, ids, SamplingParams(max_tokens=20, ignore_eos=True))  # 209 tokens computed: a third full page
    # admission: the prompt less its last token; finish: only the tokens after the pages already hashed
    assert hashed == [189, 209 - 2 * eng.layout.page_tokens], hashed
