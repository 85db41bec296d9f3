"""Decode steps fed on the device (`EngineConfig.device_feed`) against the synchronous engine: the same tokens,
finish reasons and logits; every decode row's token taken on the device from the step before; a preemption while a
token is in flight. Where the option is unset the platform decides (a GPU's default); tables that do not fit name
the fix."""

import jax
import numpy as np
import pytest
import tiny_engine

from serving.engine import programs
from serving.engine.engine import SamplingParams

pytestmark = pytest.mark.xdist_group(tiny_engine.GROUP)


prompt = tiny_engine.prompt


# greedy and seeded rows, a two-chunk prompt, stop ids that end a request early (its row runs a step more), one
# that ends at its first token; two slots, so later requests wait for earlier ones to finish
REQUESTS = {
    "a": (prompt(30, 1), SamplingParams(max_tokens=9, ignore_eos=True)),
    "b": (prompt(140, 2), SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)),
    "c": (prompt(60, 3), SamplingParams(max_tokens=8, stop_token_ids=tuple(range(0, 129280, 2)))),
    "d": (prompt(20, 5), SamplingParams(max_tokens=1)),
    "e": (prompt(40, 6), SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)),
}


def serve(eng):
    return (*tiny_engine.drain(eng, REQUESTS), eng.finished_logits)


@pytest.fixture(scope="module")
def synchronous():
    return serve(tiny_engine.make())


@pytest.mark.parametrize("split", [False, True])
def test_fed_steps_equal_synchronous(synchronous, split):
    """Every decode row takes its token from the previous step's sampled ids (its prefill call's first token, or its
    decode step's) on the device, with its Engram rows hashed and gathered there (the tiny preset's Engram layers 1
    and 3: before and after the split layer, so the split step resolves the feed in both programs), and each request
    gets the synchronous engine's tokens, finish reason and logits (within float32 summation noise). After warm-up
    nothing compiles: the fed programs and the padding of their ids ran there with a step's signatures."""
    want_t, want_r, want_l = synchronous
    eng = tiny_engine.make(device_feed=True, split_decode=split)
    assert eng.async_scheduling and programs.DEVICE_ENGRAM in eng.params
    eng.warmup()
    jits = (programs.run_full, programs.run_encoder, programs.run_decoder, programs.ONE_DEVICE.run_decode_first,
            programs.ONE_DEVICE.run_decode_rest, eng._pad, eng._pad_first)
    before = [p._cache_size() for p in jits]
    eng.programs = counted = tiny_engine.FedRows(eng.programs, ("run_full", "run_decode_first"))
    toks, reasons, logits = serve(eng)
    assert [p._cache_size() for p in jits] == before
    assert toks == want_t and reasons == want_r
    for rid in want_l:
        np.testing.assert_allclose(np.stack(logits[rid]), np.stack(want_l[rid]), rtol=0, atol=2e-5)
    # every decode row took its token on the device: the first from its prompt's prefill call, then its own
    # decode step's (a row that stopped on a stop id ran one step more)
    assert counted.host == 0 and counted.fed >= sum(len(t) - 1 for t in want_t.values())


def test_preempted_with_a_token_in_flight():
    """The pool (5 pages of 64 tokens) cannot hold both requests: a decode row's pages preempt the other request
    while its newest token is still in flight on the device. That token is read as a preempted request's, and it
    recomputes from prompt + output as the synchronous engine's preempted request does: the same tokens."""
    def run(**kw):
        eng = tiny_engine.make(**kw)
        toks, _ = tiny_engine.drain(eng, {"a": (prompt(120, 8), SamplingParams(max_tokens=12, ignore_eos=True)),
                                          "b": (prompt(180, 9), SamplingParams(max_tokens=8, ignore_eos=True))})
        return toks, eng.counters["preemptions"]

    want, _ = run()
    got, preemptions = run(device_feed=True)
    assert preemptions >= 1 and got == want


def test_the_platform_decides_where_the_option_is_unset():
    """device_feed=None: fed on a GPU (not on the CPU), speculative decoding too (tests/test_engine_speculative_feed
    .py), but not where the Engram tables a device would hold take more than FEED_TABLES_MAX_SHARE of its memory
    (Flash with tensor parallelism alone holds its 188.8 GiB tables whole on every GPU); a given value stands. The
    engine resolves it before it places anything (`platform_config`), so its compile workers and the program store's
    keys see the value it runs."""
    from dsv41.config import preset
    from serving.engine import kv_pool
    from serving.engine.config import FEED_TABLES_MAX_SHARE, EngineConfig, SpeculativeConfig
    from serving.engine.engine import platform_config

    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3)
    h200 = 141 * 2**30
    flash = preset("flash")
    dp8, tp8 = (kv_pool.engram_bytes_per_device(flash, d) for d in (8, 1))
    assert dp8 <= FEED_TABLES_MAX_SHARE * h200 < tp8
    assert not EngineConfig().feeds_on_device("cpu")
    assert EngineConfig().feeds_on_device("gpu") and EngineConfig().feeds_on_device("gpu", dp8, h200)
    assert not EngineConfig().feeds_on_device("gpu", tp8, h200)
    assert EngineConfig(speculative_config=spec).feeds_on_device("gpu")
    assert not EngineConfig(speculative_config=spec).feeds_on_device("cpu")
    assert not EngineConfig(speculative_config=spec).feeds_on_device("gpu", tp8, h200)
    assert EngineConfig(device_feed=True).feeds_on_device("cpu")
    assert EngineConfig(device_feed=True, speculative_config=spec).feeds_on_device("cpu")
    assert not EngineConfig(device_feed=False).feeds_on_device("gpu")
    assert not EngineConfig(device_feed=False, speculative_config=spec).feeds_on_device("gpu")
    cfg = tiny_engine.tiny()[0]
    assert platform_config(cfg, EngineConfig()).device_feed is False  # this CPU
    assert platform_config(cfg, EngineConfig(device_feed=True)).device_feed is True
    eng = tiny_engine.make()
    assert eng.config.device_feed is False and not eng.device_feed


def test_table_bytes_are_the_tables_rows_a_rank_holds():
    """`kv_pool.engram_bytes_per_device` (what the default and `dsv41 kv-budget` count, from the config alone)
    equals the bytes of each table's block of rows a data rank holds in the abstract parameter tree."""
    from dsv41 import params as P
    from dsv41.config import preset
    from serving.engine import kv_pool

    for name in ("tiny", "bench"):
        cfg = preset(name)
        tables = P.engram_tables(P.abstract_params(cfg))
        for ranks in (1, 3, 8):
            want = sum(-(-t.weight.shape[0] // ranks) * (t.weight.size + t.scale.size) // t.weight.shape[0]
                       for t in tables)
            assert kv_pool.engram_bytes_per_device(cfg, ranks) == want, (name, ranks)


def test_tables_that_do_not_fit_name_the_fix(monkeypatch):
    """Device memory running out while the Engram tables are placed is an EngineError that names the tables' size
    and the fix (--no-device-feed), not XLA's allocator message."""
    from serving.engine import device_feed
    from serving.engine.errors import EngineError

    def full(*a, **k):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.94GiB.")

    monkeypatch.setattr(device_feed, "split_rows", full)
    with pytest.raises(EngineError, match=r"Engram tables \(0\.0 GiB a device\).*--no-device-feed"):
        tiny_engine.make(data_parallel_size=2, num_pages=8, device_feed=True)
