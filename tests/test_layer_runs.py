"""Runs of layers that share one compiled body (dsv41/layer_runs.py): which layers form a run, the run-stacked
parameters, that a program's size stops growing with its layers, and the scanned runs against the model: the
engine (through the fused kernels' wiring, their jnp references on the CPU) against the full-sequence forward on
a schedule whose runs span several layers in the encoder and the decoder (the tiny preset's are all one layer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import layer_runs, model, quant
from dsv41 import params as P
from dsv41 import tokenizer as T
from dsv41.config import preset
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine, SamplingParams

NUM = quant.Numerics(act_quant=False, bf16_probs=False, dtype="float32")  # as tests/tiny_engine.py's


def runs_config():
    """tiny at 11 layers with every kind of run: SWA L0-1 (stacked), the ratio-2 source L2 (Engram), the ratio-1
    candidate source L3 (the split), then a periodic run L4-10: a reindex layer scoring L3's candidates and two
    reuse layers (the part of two its own inner scan), twice, and a last reindex layer (a partial period)."""
    t = preset("tiny")
    return t.replace(n_layers=11, compress_ratios=(0, 0, 2, 1, 1, 1, 1, 1, 1, 1, 1), kv_source_layers=(2, 3),
                     index_source_layers=(2, 3, 4, 7, 10), candidate_source_layer=3, engram_layer_ids=(2,),
                     engram_num_embeddings=t.engram_num_embeddings[:1])


@pytest.fixture(scope="module")
def runs_model():
    """(runs_config(), its float32 parameters with the Engram tables), seed 0."""
    cfg = runs_config()
    return cfg, P.init_params(cfg, seed=0, dtype="float32")


def layer_leaves(stacked, cfg) -> list[list[np.ndarray]]:
    """Each layer's leaves out of a run-stacked tree, sliced on the host (eager slices compile once a shape)."""
    host = jax.tree_util.tree_map(np.asarray, stacked)
    return [jax.tree_util.tree_leaves(layer_runs.layer_params(host, cfg, i)) for i in range(cfg.n_layers)]


def spans(cfg):
    return [(r.first, r.n, tuple((p.layer, c) for p, c in r.parts)) for r in layer_runs.runs(cfg)]


def test_runs_of_the_flash_schedule():
    """Flash: 10 runs, the last periodic (L21-39: three reuse layers and a reindex layer, four times, then three
    reuse layers)."""
    want = [(0, 1, ()), (1, 1, ()), (2, 1, ()), (3, 5, ()), (8, 1, ()), (9, 5, ()), (14, 1, ()), (15, 5, ()),
            (20, 1, ()), (21, 19, ((21, 3), (24, 1)))]
    assert spans(preset("flash")) == spans(preset("tiny40")) == want
    assert spans(preset("tiny")) == [(i, 1, ()) for i in range(8)]  # every layer kind once
    assert spans(runs_config()) == [(0, 2, ()), (2, 1, ()), (3, 1, ()), (4, 7, ((4, 1), (5, 2)))]
    assert layer_runs.run_of(preset("flash"), 12) == (5, 3)
    assert layer_runs.run_of(preset("flash"), 28) == (9, 7)
    assert layer_runs.runs(preset("flash"))[9].locate(7) == (1, 1, 0)  # L28: the reindex part of period 1
    with pytest.raises(ValueError, match="do not start and end at runs"):
        layer_runs.runs_between(preset("flash"), 0, 5)


def primitives(jaxpr) -> set[str]:
    """Every primitive of a jaxpr, nested ones (loop bodies, branches, calls) included."""
    from serving.engine.host_round_trips import sub_jaxprs

    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in sub_jaxprs(eqn):
            out |= primitives(sub)
    return out


@pytest.mark.parametrize("name", ["flash", "runs"])
def test_a_periodic_run_takes_each_layer_as_its_loops_slice(name):
    """`layer_runs.scan` over a periodic run whose last period holds only its first parts (Flash's L21-39: four
    periods of three reuse layers and a reindex layer, then three reuse layers; the tiny runs schedule's L4-10) visits
    each layer once, in order, on its own weights, and gives ys in layer order, as the unrolled run does. Each layer's
    weights are its loop's slice (`lax.scan`'s xs) or a buffer of their own, never a dynamic slice at a traced index
    (on a GPU XLA copies such a slice of each layer's weights: docs/PERFORMANCE.md section 9), and nothing reads a
    device value on the host (a `lax.cond` on the period)."""
    from serving.engine.host_round_trips import host_round_trips

    cfg = preset("flash") if name == "flash" else runs_config()
    run = layer_runs.runs(cfg)[-1]
    assert run.parts and run.n % run.period  # a partial last period
    weights = [{"w": jnp.full((64,), float(i))} for i in range(cfg.n_layers)]
    stacked = layer_runs.stack_layers(weights, cfg)[-1]

    def body(state, lp, layer, view):
        prev, in_order = state  # each layer's weight is its index: visited in order, each on its own weights
        w = lp["w"][0]
        return (w, in_order & (w == prev + 1)), (w, jnp.asarray(layer, jnp.float32))

    def run_it(params, unroll):
        return layer_runs.scan(body, (jnp.float32(run.first - 1), jnp.bool_(True)), run, params, unroll=unroll)

    layers = np.arange(run.first, run.first + run.n, dtype=np.float32)
    for state, ys in (jax.jit(lambda p: run_it(p, False))(stacked), run_it(stacked, True)):
        assert bool(state[1]) and float(state[0]) == layers[-1]
        np.testing.assert_array_equal(np.asarray(ys[0]), layers)
        np.testing.assert_array_equal(np.asarray(ys[1]), layers)
    jaxpr = jax.jit(lambda p: run_it(p, False)).trace(stacked).jaxpr
    assert host_round_trips(jaxpr) == []
    assert not primitives(jaxpr.jaxpr) & {"dynamic_slice", "gather", "cond"}, primitives(jaxpr.jaxpr)


def test_stacked_layers_hold_each_layer(runs_model):
    cfg, params = runs_model
    stacked = layer_runs.stack_params(params, cfg)
    assert "layers" not in stacked and layer_runs.stack_params(stacked, cfg) is stacked
    assert stacked[layer_runs.RUNS_KEY][0]["attn"]["wq_a"].shape[0] == 2  # L0-1
    periodic = stacked[layer_runs.RUNS_KEY][3]  # L4-10: (a reindex layer, two reuse layers) twice, a reindex layer
    assert [p["attn"]["wq_a"].shape[:2] for p in periodic.whole] == [(2, 1), (2, 2)]
    assert [p["attn"]["wq_a"].shape[:1] for p in periodic.tail] == [(1,)]
    for i, got in enumerate(layer_leaves(stacked, cfg)):
        want = jax.tree_util.tree_leaves(params["layers"][i])
        assert len(got) == len(want) and all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))


def test_consumed_stacking_holds_the_weights_once(runs_model, monkeypatch):
    """consume=True (the engine on the tree it loaded): the per-layer arrays go as their stacks come, so the live
    device bytes never exceed the weights plus one leaf of one run, and end where they began, but for the padding
    of the small leaves' layers."""
    cfg, params = runs_model
    own = jax.tree_util.tree_map(jnp.array, params)  # a copy to hand over
    live = lambda: sum(a.nbytes for a in jax.live_arrays())  # noqa: E731
    before, peaks, stacker = live(), [], layer_runs._stacker

    def recording(sharding, lead, *padded):
        fn = stacker(sharding, lead, *padded)
        return lambda *xs: (out := fn(*xs), peaks.append(live() - before))[0]

    monkeypatch.setattr(layer_runs, "_stacker", recording)
    stacked = layer_runs.stack_params(own, cfg, consume=True)
    largest = max(x.nbytes for x in jax.tree_util.tree_leaves(params["layers"]))
    assert peaks and max(peaks) <= largest * max(r.n for r in layer_runs.runs(cfg))
    # what the stacks add: each layer of a small replicated leaf padded to ALIGN bytes (`layer_runs.Padded`)
    grown = sum(a.nbytes for a in jax.tree_util.tree_leaves(stacked)) - sum(
        a.nbytes for a in jax.tree_util.tree_leaves(params))
    assert live() == before + grown and 0 <= grown < cfg.n_layers * layer_runs.ALIGN * len(
        jax.tree_util.tree_leaves(params["layers"][0]))
    assert own["layers"][7]["attn"]["wq_a"].is_deleted() and not own["layers"][2]["attn"]["wq_a"].is_deleted()
    for i, got in enumerate(layer_leaves(stacked, cfg)):
        assert all(np.array_equal(np.asarray(g), np.asarray(w))
                   for g, w in zip(got, jax.tree_util.tree_leaves(params["layers"][i])))


def test_every_layer_of_a_stack_starts_aligned(runs_model):
    """A scanned layer's slice of a stack reaches a Mosaic GPU kernel in place (XLA's dynamic-slice fusion) and the
    kernels take only 256-byte aligned operands: every stack's layer stride is a multiple of ALIGN bytes (the small
    leaves `Padded`), and the layers read back as they were."""
    cfg, params = runs_model
    stacked = layer_runs.stack_params(params, cfg)
    is_padded = lambda x: isinstance(x, layer_runs.Padded)  # noqa: E731
    n_padded = 0
    for group in stacked[layer_runs.RUNS_KEY]:
        if isinstance(group, list):  # a run of one: the layer's own buffers
            continue
        parts = ([(p, 2) for p in group.whole] + [(p, 1) for p in group.tail]
                 if isinstance(group, layer_runs.Periodic) else [(group, 1)])
        for part, lead in parts:
            for x in jax.tree_util.tree_leaves(part, is_leaf=is_padded):
                n_padded += is_padded(x)
                data = x.data if is_padded(x) else x
                assert np.prod(data.shape[lead:]) * data.dtype.itemsize % layer_runs.ALIGN == 0, data.shape
    assert n_padded  # the tiny preset has leaves of a few bytes (the mHC scale [3])
    for i, got in enumerate(layer_leaves(stacked, cfg)):
        want = jax.tree_util.tree_leaves(params["layers"][i])
        assert all(g.shape == w.shape and np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))


def lowered_forward_chars(cfg) -> int:
    core, tables = model.strip_tables(P.abstract_params(cfg))
    core = layer_runs.stack_params({k: v for k, v in core.items() if k not in P.VISION_KEYS}, cfg)
    S = 16
    rows = [jax.eval_shape(lambda t: model.engram.gather_rows(t, jnp.zeros((1, S, cfg.engram_n_cols), jnp.int32)),
                           t) for t in tables]
    ids = jax.ShapeDtypeStruct((1, S), jnp.int32)
    return len(model._forward.lower(core, ids, rows, cfg=cfg, num=NUM).as_text())


def test_forty_layers_lower_to_a_program_not_five_times_eight():
    """The 40-layer schedule's program holds its 10 runs' 12 bodies (1.66x the 8-layer one's 8: the periodic run's
    two parts in its loop, then its partial period's first part after it), not 40 layers (5x): compile time
    follows the program's size."""
    ratio = lowered_forward_chars(preset("tiny40")) / lowered_forward_chars(preset("tiny"))
    assert ratio < 1.7, ratio  # 1.66 (the partial period behind a cond in the loop: 1.55; no periodic runs: 2.33)


def test_engine_with_scanned_runs_equals_forward(runs_model):
    """A prefill chunk and decode steps through scanned runs with the fused kernels' wiring ('reference': their jnp
    references) against the full-sequence model. Exact prefill (two programs; the encoder and decoder programs
    run the same `_layers`, the split layer a run of one)."""
    cfg, params = runs_model
    eng = Engine(cfg, params, T.load_tokenizer(), model.builtin_hasher(cfg), EngineConfig(
        max_num_seqs=2, max_model_len=256, max_num_batched_tokens=128, numerics=NUM, keep_logits=True,
        min_prefill_bucket=128, min_decode_bucket=2, num_pages=5, attention_backend="reference",
        swa_bounded_replay=False, scan_layers=True))
    ids = list(np.random.default_rng(0).integers(3, 1000, 100))
    eng.add_request("r", ids, SamplingParams(max_tokens=4, ignore_eos=True))
    toks = []
    while eng.has_work():
        toks += [t for o in eng.step() for t in o.new_token_ids]
    logits = np.stack(eng.finished_logits["r"])
    full = np.asarray(model.forward(params, cfg, np.asarray([ids + toks[:-1]]), NUM))[0, len(ids) - 1:]
    assert np.abs(logits - full).max() < 1e-3  # test_engine.py's TOL_FORWARD
    assert toks == list(full.argmax(-1))
