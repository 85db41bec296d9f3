"""The engine on a device mesh (8 virtual CPU devices, tests/conftest.py) against the one-device engine.

- Data parallel without EP changes no arithmetic (each rank runs its rows as one device would), so its logits
  must be the one-device engine's bit for bit: this checks routing, rank-local pages and slots, the per-rank
  pools, prefix hits and the batch layout.
- Expert parallelism changes summation orders: the expert-parallel op, without a pool, is checked to float32
  summation order (1e-5). (Engines under TP / EP run in tests/test_multihost.py, across two processes, and with
  DSpark here when DSV41_TEST_MESH_TP=1: its greedy tokens on the tiny preset are the one-device engine's.)
"""

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest

import tiny_engine
from dsv41 import moe, sharding
from dsv41.ops import XLA
from serving.engine.config import SpeculativeConfig
from serving.engine.engine import EngineError, SamplingParams

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
pytestmark = [needs8]

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
# one worker runs the mesh engine tests: they share `one_device` (its programs and its run) and the one-device
# engine's programs
MESH_GROUP = "mesh_engine"
PROMPTS = [list(np.random.default_rng(0).integers(3, 1000, n)) for n in (150, 40, 200)]


def serve(eng):
    """Three conversations at once, then a second turn of the first (a prefix-cache hit on its rank).
    -> (tokens by request, logits by request, the rank of each request)."""
    toks: dict[str, list[int]] = {}
    ranks = {}

    def drain():
        while eng.has_work():
            for r in eng.running.values():
                ranks[r.id] = r.rank
            for o in eng.step():
                toks.setdefault(o.request_id, []).extend(o.new_token_ids)

    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY, session=f"s{i}")
    drain()
    eng.add_request("r0b", PROMPTS[0] + toks["r0"] + list(range(10, 40)), GREEDY, session="s0")
    drain()
    return toks, {k: np.stack(v) for k, v in eng.finished_logits.items()}, ranks


@functools.lru_cache(maxsize=None)
def one_device(replay: bool):
    return serve(tiny_engine.make(swa_bounded_replay=replay))


@pytest.mark.xdist_group(MESH_GROUP)
@pytest.mark.parametrize("replay", [True], ids=["replay"])
def test_data_parallel_is_the_one_device_engine_bit_for_bit(replay):
    """Also with a GPU's decode step (`split_decode`: two programs a step, each per data rank) against the
    one-device engine's one program."""
    eng = tiny_engine.make(data_parallel_size=2, swa_bounded_replay=replay, num_pages=8, split_decode=True)
    assert eng.decode_kinds == ("decode_first", "decode_rest")
    toks, logits, ranks = serve(eng)
    ref_toks, ref_logits, _ = one_device(replay)
    assert toks == ref_toks
    for k in ref_logits:
        np.testing.assert_array_equal(logits[k], ref_logits[k], err_msg=k)
    assert len(set(ranks.values())) == 2, ranks  # the conversations spread over both ranks
    assert ranks["r0b"] == ranks["r0"]  # session affinity: the second turn on the first's rank
    st = eng.stats()
    assert len(st["running_per_rank"]) == 2 and sum(st["kv_pages_total_per_rank"]) == st["kv_pages_total"]
    if replay:  # prefix caching is on with replay: the second turn hit its rank's cache, the other rank nothing
        hits = st["prefix_cache_hit_tokens_per_rank"]
        assert hits[ranks["r0"]] >= 2 * eng.layout.page_tokens and sum(hits) == hits[ranks["r0"]]


@pytest.mark.xdist_group(MESH_GROUP)
def test_device_feed_on_data_ranks():
    """Decode tokens fed on the device on two data ranks: each rank's rows take their tokens from its own slice of
    the previous step's ids (`programs.Feed`, rank-local indices) and gather Engram rows from the tables whole on
    every device; the one-device synchronous engine's tokens, the second turn's prefix hit included."""
    eng = tiny_engine.make(data_parallel_size=2, num_pages=8, device_feed=True)
    toks, logits, ranks = serve(eng)
    ref_toks, ref_logits, _ = one_device(True)
    assert toks == ref_toks and len(set(ranks.values())) == 2
    for k in ref_logits:
        np.testing.assert_allclose(logits[k], ref_logits[k], rtol=0, atol=2e-5, err_msg=k)


def test_engram_rows_split_with_padding():
    """A table whose rows do not divide the data ranks: each rank's block read from it, the last padded with zeros."""
    from serving.engine.device_feed import split_rows

    mesh = sharding.make_mesh(sharding.Parallelism(data=4, tensor=2))
    a = np.arange(7 * 3, dtype=np.uint8).reshape(7, 3)
    got = split_rows(a, sharding.rank_sharding(mesh), 4)
    assert got.shape == (8, 3) and [s.data.shape for s in got.addressable_shards] == [(2, 3)] * 8
    np.testing.assert_array_equal(np.asarray(got), np.concatenate([a, np.zeros((1, 3), np.uint8)]))


# DSpark on tensor and expert ranks too costs CI ~20 s more of compiles (2-core CPU, empty cache): asked for with
# DSV41_TEST_MESH_TP=1 (it passes: the one-device engine's greedy tokens)
SPEC_LAYOUTS = [dict(data_parallel_size=2),
                pytest.param(dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
                             marks=pytest.mark.skipif(os.environ.get("DSV41_TEST_MESH_TP") != "1",
                                                      reason="DSV41_TEST_MESH_TP=1 runs it (CI time)"))]


@pytest.mark.xdist_group(MESH_GROUP)
@pytest.mark.parametrize("layout", SPEC_LAYOUTS, ids=["dp2", "dp2xtp2+ep"])
def test_speculative_decoding_on_mesh_ranks(layout):
    """DSpark (k = 5) on two data ranks (and, asked for, two tensor ranks each with experts over all four
    devices): each data rank verifies and drafts its own rows in its own pool (rings, pages, the drafter's
    states), the drafter's heads, widths and experts split as the model's; greedy tokens are the one-device
    engine's without speculation, the second turn's prefix-cache hit on its rank included. Random weights reject
    nearly every draft, so a draft's rollback that left a trace on either rank would move a token. The step split
    at the split layer, as a GPU runs it."""
    eng = tiny_engine.make(**layout, speculative_config=SpeculativeConfig(num_speculative_tokens=5),
                           max_model_len=tiny_engine.BASE["max_model_len"] - 5,  # the block tables stay 8 pages
                           split_decode=True)
    assert eng.decode_kinds == ("decode_first", "spec_rest")
    toks, _, ranks = serve(eng)
    assert toks == one_device(True)[0]
    assert len(set(ranks.values())) == 2 and ranks["r0b"] == ranks["r0"]
    assert eng.counters["spec_drafts"] > 0 and sum(eng.stats()["prefix_cache_hit_tokens_per_rank"]) > 0


@pytest.mark.xdist_group(MESH_GROUP)
def test_one_rank_out_of_pages_preempts_only_there():
    """Rank 0 admits two requests of four pages each whose outputs do not fit its 8 pages together: it preempts
    one of them (recomputed later); the other rank's request runs as on one device. 8 pages and the split decode
    step: the engine of `test_data_parallel_is_the_one_device_engine_bit_for_bit[replay]`, whose compiled programs
    this one reuses."""
    eng = tiny_engine.make(data_parallel_size=2, num_pages=8, split_decode=True)
    a, b = list(range(3, 253)), list(range(300, 550))  # 4 pages each; 10 tokens more: 5
    for rid, p, s in (("a", a, "x"), ("c", PROMPTS[1], "y"), ("b", b, "x")):  # a, b share session x: rank 0
        eng.add_request(rid, p, SamplingParams(max_tokens=10, ignore_eos=True), session=s)
    toks: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert eng.counters["preemptions"] >= 1
    assert {k: len(v) for k, v in toks.items()} == {"a": 10, "b": 10, "c": 10}
    ref = tiny_engine.make()  # the one-device engine of `one_device`: its programs are compiled in this group
    assert ref.generate(PROMPTS[1], SamplingParams(max_tokens=10, ignore_eos=True)) == toks["c"]


@pytest.mark.xdist_group(MESH_GROUP)
@pytest.mark.parametrize("exchange", sharding.ALL2ALL_BACKENDS)
@pytest.mark.parametrize("par", [sharding.Parallelism(data=4, expert=True),
                                 sharding.Parallelism(data=2, tensor=2, expert=True)], ids=["dep4", "dp2xtp2+ep"])
def test_expert_parallel_op_is_the_plain_moe(par, exchange):
    """Both token exchanges, at a prefill-like 10 and a decode-like 2 tokens a data rank. The ragged one runs
    through `ragged_all_to_all_reference` (XLA's CPU backend has no ragged-all-to-all); with the collective itself
    the program must still lower (its shard_map typing is checked on the CPU too). Neither adds floats by a
    scatter (atomics on a GPU, in an order that varies run to run)."""
    from test_gpu_conversions import _float_scatter_adds

    cfg, params = tiny_engine.tiny()
    mesh = sharding.make_mesh(par)
    placed = sharding.place_params(params, cfg, par, mesh)
    p = placed["layers"][3]["ffn"]
    specs = jax.tree_util.tree_map(lambda a: sharding.manual_spec(a.sharding), p)
    R = sharding.rank_sharding(mesh).spec

    def program(ragged):
        ep = dataclasses.replace(XLA, routed_experts=sharding.ExpertParallel(moe.routed_experts, par.tensor, exchange,
                                                                             ragged))
        return jax.jit(jax.shard_map(lambda p, x: moe.moe(x, p, cfg, tiny_engine.NUM, ops=ep), mesh=mesh,
                                     in_specs=(specs, R), out_specs=R, axis_names={sharding.DATA}))

    for T in (5, 1):
        x = np.random.default_rng(T).standard_normal((8, T, cfg.dim)).astype(np.float32)
        want = moe.moe(x, params["layers"][3]["ffn"], cfg, tiny_engine.NUM)
        got = program(sharding.ragged_all_to_all_reference)(p, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    adds = []
    _float_scatter_adds(jax.make_jaxpr(program(sharding.ragged_all_to_all_reference))(p, x).jaxpr, adds)
    assert not adds, adds
    if exchange == "ragged_all_to_all":
        assert "ragged_all_to_all" in program(jax.lax.ragged_all_to_all).lower(p, x).as_text()


@pytest.mark.parametrize("kw, msg", [
    (dict(enable_expert_parallel=True), "needs --data-parallel-size > 1"),
    (dict(data_parallel_size=2, all2all_backend="ragged_all_to_all"), "add --enable-expert-parallel"),
    (dict(tensor_parallel_size=3), "cannot be split 3 ways"),
    (dict(tensor_parallel_size=4, data_parallel_size=4), "asks for 16 devices but 8 are present"),
])
def test_bad_layouts_fail_before_anything_runs(kw, msg):
    with pytest.raises(EngineError, match=msg):
        tiny_engine.make(**kw)


def test_bad_layout_fails_before_a_checkpoint_loads(tmp_path, monkeypatch):
    """from_checkpoint checks the layout against config.json before it reads any weight."""
    from dsv41 import checkpoint
    from dsv41.config import preset
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    monkeypatch.setattr(checkpoint, "_read_layout", lambda *a: pytest.fail("weights were read"))
    monkeypatch.setattr(checkpoint, "_read_config", lambda path, cfg: preset("tiny"))
    with pytest.raises(EngineError, match="cannot be split 3 ways"):
        Engine.from_checkpoint(str(tmp_path), config=EngineConfig(tensor_parallel_size=3))


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(data_parallel_size=4, enable_expert_parallel=True),
                                dict(data_parallel_size=2, tensor_parallel_size=4, enable_expert_parallel=True)],
                         ids=["tp2", "dep4", "dp2xtp4+ep"])
def test_capacity_plan_is_what_the_engine_allocates(kw):
    """`kv_pool.capacity` (abstract shard shapes, no devices) against the bytes an engine on the mesh places on
    each device: its weights, and its rank's pool (pages x page tokens x KV bytes per token + slots x slot bytes)."""
    from serving.engine import kv_pool

    eng = tiny_engine.make(num_pages=8, **kw)  # builds and places; compiles nothing
    par = eng.config.parallelism
    plan = kv_pool.capacity(eng.cfg, par, 2**30, weights_dtype="float32")
    placed = {**eng.params, **(eng.vision_params or {})}  # the vision program's weights are kept apart
    weights = sharding.per_device_bytes(placed, jax.tree_util.tree_map(lambda a: a.sharding, placed))
    assert set(weights.values()) == {plan.weight_bytes_per_device}, (weights, plan)
    pool = sharding.per_device_bytes(eng.pool, jax.tree_util.tree_map(lambda a: a.sharding, eng.pool))
    lay = eng.layout
    want = lay.num_pages * lay.page_tokens * plan.kv_bytes_per_token + lay.num_slots * plan.slot_bytes
    assert len(pool) == par.devices and set(pool.values()) == {want}


def test_kv_budget_plans(capsys):
    from serving import cli

    assert cli.main(["kv-budget", "--plans"]) == 0
    out = capsys.readouterr().out
    assert "8x H200" in out and "GB300 NVL72" in out and "cannot be split 72 ways" in out
    # where serve holds Flash's Engram tables by default: whole on each GPU of TP8 (188.8 GiB) is over a quarter of
    # an H200, an eighth a GPU of DP8 is not
    rows = [line.split() for line in out.splitlines() if line.startswith("8x H200")]
    assert ["TP8", "8", "host"] in [r[2:5] for r in rows], out
    assert ["TP1", "x", "DP8", "+", "EP", "8", "GPU"] in [r[2:9] for r in rows], out
    assert cli.main(["kv-budget", "--data-parallel-size", "8", "--enable-expert-parallel", "--no-device-feed"]) == 0
    out = capsys.readouterr().out
    assert "TP1 x DP8 + EP (8 GPUs)" in out
    # by default (serve's on GPUs) Flash's Engram tables (188.8 GiB) in device memory too, an eighth a GPU
    assert cli.main(["kv-budget", "--data-parallel-size", "8", "--enable-expert-parallel"]) == 0
    w = [float(line.split()[-2]) for o in (out, capsys.readouterr().out) for line in o.splitlines()
         if line.startswith("weights / GPU")]
    assert abs(w[1] - w[0] - 188.8 / 8) < 0.1, w
    assert cli.main(["kv-budget"]) == 1  # the full model on one H200: the weights alone do not fit
    assert cli.main(["kv-budget", "--data-parallel-size", "8", "--all2all-backend", "ragged_all_to_all"]) == 2


def test_the_engine_exchanges_tokens_as_asked():
    """--all2all-backend reaches the programs' routed-experts op; the CPU exchanges through the all-gather form
    (`test_expert_parallel_op_is_the_plain_moe` checks both exchanges' numbers)."""
    eng = tiny_engine.make(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="ragged_all_to_all")
    op = eng.backends.ops.routed_experts
    assert (op.exchange, op.ragged) == ("ragged_all_to_all", sharding.ragged_all_to_all_reference)


@pytest.mark.parametrize("kw", [dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
                                dict(tensor_parallel_size=4), dict(data_parallel_size=3, device_feed=True)],
                         ids=["dep2xtp2", "tp4", "dp3+feed"])
def test_abstract_mesh_engine_keys_every_program_as_the_allocated_one(kw):
    """`Engine.abstract` on a mesh (jax.ShapeDtypeStructs placed as the rules place the weights, the KV pool split by
    data rank) traces the same programs with the same argument shardings as the allocated engine: their program
    store keys are equal, and each lowers (so a model larger than the devices compiles ahead of time, sharded).
    With device_feed the Engram tables are program arguments, their rows padded to split over 3 data ranks."""
    from dsv41.config import preset
    from serving.engine import executables
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    config = EngineConfig(max_num_seqs=2, max_model_len=128, **kw)

    def keys(eng):
        for shape in eng.program_shapes():
            fn, (params, pool, *args), static = eng._padding_call(*shape)
            yield executables.key(fn.name, *fn._args(params, pool, tuple(args), static), fn.compiler_options)

    abstract = Engine.abstract(preset("tiny"), config)
    assert list(keys(Engine.from_preset("tiny", config=config))) == list(keys(abstract))
    fn, (params, pool, *args), static = abstract._padding_call(*abstract.program_shapes()[-1])
    devices = config.parallelism.devices
    assert f"mhlo.num_partitions = {devices}" in fn.lower(params, pool, *args, **static).as_text()


@pytest.mark.parametrize("feed", [False, True], ids=["read", "fed"])
def test_split_speculative_step_lowers_on_data_ranks(feed):
    """`split_decode=True` under DSpark on two data ranks (an abstract engine: nothing compiles or runs): the step's
    two programs, `run_decode_first` on the speculative chunk and `run_spec_rest` (and its all-greedy variant,
    `SpeculativeConfig.greedy_program`), each lower per rank, also with the chunk fed on the device
    (`programs.SpecFeed`: each rank's slice of the previous step's outputs). (The split step's tokens:
    tests/test_engine_speculative.py and tests/test_engine_speculative_feed.py, one device.)"""
    from dsv41.config import preset
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    spec = SpeculativeConfig(num_speculative_tokens=5, greedy_program=True)
    config = EngineConfig(max_num_seqs=2, max_model_len=128, data_parallel_size=2, split_decode=True,
                          speculative_config=spec, device_feed=feed)
    eng = Engine.abstract(preset("tiny"), config)
    assert eng.decode_kinds == ("decode_first", "spec_rest") and eng.greedy_kind == "spec_rest_greedy"
    kinds = (*eng.decode_kinds, eng.greedy_kind)
    shapes = [s for s in eng.program_shapes() if s[0] in kinds]
    assert {s[0] for s in shapes} == set(kinds) and all(s[2] == eng.decode_tokens for s in shapes)
    for shape in shapes:
        fn, (params, pool, *args), static = eng._padding_call(*shape)
        assert "mhlo.num_partitions = 2" in fn.lower(params, pool, *args, **static).as_text(), shape


@pytest.mark.xdist_group(MESH_GROUP)
def test_staged_warmup_buckets_count_every_data_rank():
    """While a staged warm-up compiles, a step's program is the smallest usable one that holds it, its rows
    counting every data rank's (nothing runs: the buckets only). DP2, up to 4 sequences a rank."""
    from types import SimpleNamespace

    eng = tiny_engine.make(data_parallel_size=2, max_num_seqs=4, min_decode_bucket=1, min_prefill_bucket=32,
                           max_prefill_rows=2, split_decode=True)
    c = eng.max_pages_per_seq
    assert eng.shared_prefill == (2, 64)
    assert eng.covering_shapes() == [("encoder", 2, 128, c), ("decoder", 2, 1, c), ("decode_first", 8, 1, c),
                                     ("decode_rest", 8, 1, c)]
    one = [SimpleNamespace(rank=1)]
    assert len(eng._decode_rows(one)) == 2  # one row a rank
    eng.usable_shapes = frozenset(eng.covering_shapes())
    assert len(eng._decode_rows(one)) == 8 and eng._decode_rows(one)[4] is one[0]  # rank 1's rows start at 4
    assert eng._usable("encoder", 2, 32) == (2, 128)
    assert eng._shared_picks({0: [], 1: []}) is None  # the shared call's programs are not usable: not tried
    eng.usable_shapes |= {("decode_first", 4, 1, c)}
    assert len(eng._decode_rows(one)) == 8  # a split decode step needs both its programs
    eng.usable_shapes |= {("decode_rest", 4, 1, c)}
    assert len(eng._decode_rows(one)) == 4
