"""`serving.engine.host_round_trips`: on small programs, the ops XLA's GPU backend runs by reading a device value on
the host mid-call and those it does not; then the engine's GPU decode step, which must have none."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from serving.engine.host_round_trips import host_round_trips

x = jnp.arange(8.0)


def trips(f, *args):
    return host_round_trips(jax.jit(f).trace(*args).jaxpr)


def test_a_cond_on_a_device_value_and_a_data_dependent_loop_count():
    def f(v):
        with jax.named_scope("pick"):
            v = jax.lax.cond(v[0] > 0, jnp.sin, jnp.cos, v)
        with jax.named_scope("loop"):
            n = jnp.argmax(v).astype(jnp.int32)
            return jax.lax.fori_loop(0, n, lambda i, a: a + i, v)  # a traced bound: a while loop

    assert trips(f, x) == [("cond", "pick"), ("while", "loop")]


def test_host_callbacks():
    def f(v):
        with jax.named_scope("log"):
            jax.debug.print("{}", v[0])
        return jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(v.shape, v.dtype), v)

    assert trips(f, x) == [("callback", "log"), ("callback", "")]


def test_nested_in_a_branch_and_under_vmap():
    def inner(v):
        with jax.named_scope("inner"):
            return jax.lax.cond(v.sum() > 0, lambda a: a + 1, lambda a: a, v)

    def f(v):
        return jax.lax.cond(v[0] > 0, inner, lambda a: a, v)

    assert trips(f, x) == [("cond", ""), ("cond", "inner")]
    assert trips(jax.vmap(inner), x[None]) == []  # a per-row predicate: both branches run, then a select


def test_static_trip_counts_platform_choices_and_kernel_bodies_are_not_round_trips():
    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.fori_loop(0, x_ref[0].astype(jnp.int32), lambda i, a: a + 1.0, x_ref[...])

    def f(v):
        v = jax.lax.fori_loop(0, 3, lambda i, a: a * 2, v)  # static bounds: a scan
        v = jax.lax.scan(lambda c, a: (c + a, c), 0.0, v)[1]
        v = jax.lax.platform_dependent(v, cpu=jnp.sin, default=jnp.cos)
        v = jax.lax.cond(True, jnp.sin, jnp.cos, v)  # a literal predicate
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), interpret=True)(v)

    assert trips(f, x) == []


def gpu_decode_trips(cfg, config) -> dict:
    """{program kind: its round trips} of the decode step a GPU engine of cfg and config builds (`Engine.abstract`:
    traced only, no lowering, nothing allocated), every decode program shape."""
    from unittest import mock

    from serving.engine.engine import Engine

    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        eng = Engine.abstract(cfg, config)
    out = {}
    for shape in eng.program_shapes():
        if shape[0] in eng.decode_kinds + (eng.greedy_kind,):
            fn, args, static = eng._padding_call(*shape)
            out[shape] = host_round_trips(fn.trace(*args, **static).jaxpr)
    return out


def test_a_gpu_decode_step_waits_for_no_host_value():
    """The bench preset's decode step (Flash's widths) as a GPU engine builds it with serve's defaults (a 131072-token
    block table), its tokens fed on the device and read on the host, cut at the split layer: no program of it stops
    the host mid-call, so each call returns once launched and the host prepares the next step meanwhile. The tiny
    preset's GPU engine has some (it scores some indexers' context by blocks in a loop, `indexer.running_topk`), so
    this is the bench preset's."""
    from dsv41.config import preset
    from serving.engine.config import EngineConfig

    for feed in (True, False):
        trips_of = gpu_decode_trips(preset("bench"), EngineConfig(max_num_seqs=1, device_feed=feed))
        assert [s[0] for s in trips_of] == ["decode_first", "decode_rest"]
        for shape, t in trips_of.items():
            assert t == [], (feed, shape)


def test_a_gpu_speculative_step_waits_for_no_host_value():
    """The same for DSpark's step (k = 5, cut at the split layer): its verify chunk's indexers score in one pass,
    through the decode kernel as a decode step's do (`programs._kernel_index_topk`), so the first half has no round
    trip; its sampling branch is the host's (`SpeculativeConfig.greedy_program`, a GPU's default: the all-greedy
    program, or the one filtering every row), so neither program of the second half has one. With the branch on
    the device instead (greedy_program false): two, one where it verifies and one where it drafts the block
    (`spec_sampling.batch_branch`), not one a draw."""
    from dsv41.config import preset
    from serving.engine.config import EngineConfig, SpeculativeConfig

    for greedy_program in (None, False):
        trips_of = {s[0]: t for s, t in gpu_decode_trips(preset("bench").replace(n_mtp_layers=3), EngineConfig(
            max_num_seqs=1, device_feed=False,
            speculative_config=SpeculativeConfig(greedy_program=greedy_program))).items()}
        if greedy_program is None:
            assert trips_of == {"decode_first": [], "spec_rest": [], "spec_rest_greedy": []}
        else:
            assert list(trips_of) == ["decode_first", "spec_rest"] and trips_of["decode_first"] == []
            assert sorted(trips_of["spec_rest"]) == [("cond", "dspark"), ("cond", "head_sample")]
