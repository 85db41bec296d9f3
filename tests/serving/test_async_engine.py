"""AsyncEngine over FakeEngine: routing, refusals, abort on close, step failures, shutdown."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine

from serving.async_engine import (AsyncEngine, EngineDead, EngineError, EngineStepError, QueueFull, QueueTimeout,
                                  SamplingParams)
from serving.metrics import ServingMetrics


def _run(coro_fn, **engine_kw):
    async def main():
        aeng = AsyncEngine(FakeEngine(**engine_kw), metrics=ServingMetrics())
        aeng.start()
        try:
            return await coro_fn(aeng)
        finally:
            await aeng.shutdown()

    return asyncio.run(main())


def test_generate_routes_outputs_and_counts_metrics():
    async def body(aeng):
        async def one(i):
            return [o async for o in aeng.generate(f"r{i}", [0, 5 + i, 6], SamplingParams(max_tokens=4 + i,
                                                                                        ignore_eos=True))]

        outs = await asyncio.gather(*(one(i) for i in range(6)))
        return aeng, outs

    aeng, outs = _run(body)
    for i, seq in enumerate(outs):
        assert all(o.request_id == f"r{i}" for o in seq)
        assert sum(len(o.new_token_ids) for o in seq) == 4 + i
        assert seq[-1].finished and seq[-1].finish_reason == "length" and not any(o.finished for o in seq[:-1])
    m = aeng.metrics
    assert m.sample("dsv41:time_to_first_token_seconds_count") == 6
    assert m.sample("dsv41:request_queue_time_seconds_count") == 6
    assert m.sample("dsv41:generation_tokens_total") == sum(4 + i for i in range(6))
    assert aeng.num_in_flight == 0


def test_refusals_raise_in_their_own_add_only():
    async def body(aeng):
        # 10_000 tokens of 1 ms steps: still in flight when its id comes again (with 2 tokens it could finish
        # first on a loaded machine, and the second add was then no repeat)
        good = asyncio.create_task(aeng.add("ok", [0, 1, 2], SamplingParams(max_tokens=10_000, ignore_eos=True)))
        with pytest.raises(EngineError, match="empty prompt"):
            await aeng.add("bad", [], SamplingParams())
        stream = await good
        first = await stream.__anext__()
        with pytest.raises(EngineError, match="already in flight"):
            await aeng.add("ok", [0, 1], SamplingParams())
        stream.abort()
        return first, stream

    first, stream = _run(body)
    assert first.request_id == "ok" and not first.finished and stream.finish_reason == "abort"
    with pytest.raises(QueueFull):
        _run(lambda aeng: aeng.add("q", [0, 1], SamplingParams()), max_waiting=0)


def test_closing_a_stream_early_aborts_and_frees_pages():
    async def body(aeng):
        gen = aeng.generate("long", [0, 1, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True))
        first = await gen.__anext__()
        await gen.aclose()
        stats = await aeng.stats()
        for _ in range(100):
            if stats["running"] == 0:
                break
            await asyncio.sleep(0.01)
            stats = await aeng.stats()
        return first, stats, aeng.engine.aborted

    first, stats, aborted = _run(body)
    assert first.request_id == "long" and not first.finished
    assert aborted == ["long"] and stats["running"] == 0 and stats["kv_pages_used"] == 0


def test_step_failure_fails_requests_in_flight_and_the_loop_goes_on():
    async def body(aeng):
        await asyncio.get_running_loop().run_in_executor(
            None, aeng.call_in_engine_thread, lambda e: setattr(e, "fail_next_steps", 1))
        stream = await aeng.add("a", [0, 1], SamplingParams(max_tokens=3))
        with pytest.raises(EngineStepError, match="injected step failure"):
            async for _ in stream:
                pass
        after = [o async for o in aeng.generate("b", [0, 1], SamplingParams(max_tokens=3, ignore_eos=True))]
        return after, aeng.healthy

    after, healthy = _run(body)
    assert after[-1].finished and healthy


def test_dead_engine_refuses_with_a_clear_error():
    async def body():
        aeng = AsyncEngine(FakeEngine())
        with pytest.raises(EngineDead, match="start"):
            await aeng.add("x", [0], SamplingParams())
        aeng.start()
        await aeng.shutdown()
        with pytest.raises(EngineDead, match="stopped"):
            await aeng.add("x", [0], SamplingParams())

    asyncio.run(body())


def test_engine_thread_crash_fails_requests_and_later_adds():
    class Crashy(FakeEngine):
        crash = False

        def has_work(self):
            if self.crash:
                raise RuntimeError("boom")
            return super().has_work()

        def step(self):
            self.crash = True  # the loop's next has_work() raises: the thread dies
            return super().step()

    async def body():
        aeng = AsyncEngine(Crashy())
        aeng.start()
        stream = await aeng.add("a", [0, 1], SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(EngineDead, match="crashed"):
            async for _ in stream:
                pass
        assert not aeng.alive and not aeng.healthy
        with pytest.raises(EngineDead, match="crashed"):
            await aeng.add("b", [0, 1], SamplingParams())
        await aeng.shutdown()

    asyncio.run(body())


def test_a_request_past_max_queue_wait_is_dropped_and_the_running_one_goes_on():
    async def main():
        aeng = AsyncEngine(FakeEngine(max_num_seqs=1, step_delay_s=0.002), metrics=ServingMetrics(),
                           max_queue_wait_s=0.1)
        aeng.start()
        try:
            hog = await aeng.add("hog", [0, 1, 2], SamplingParams(max_tokens=200, ignore_eos=True))
            late = await aeng.add("late", [0, 3], SamplingParams(max_tokens=2))
            with pytest.raises(QueueTimeout, match="waited over 0.1 s"):
                async for _ in late:
                    pass
            outs = [o async for o in hog]
            return aeng, outs
        finally:
            await aeng.shutdown()

    aeng, outs = asyncio.run(main())
    assert sum(len(o.new_token_ids) for o in outs) == 200 and outs[-1].finish_reason == "length"
    assert "late" in aeng.engine.aborted and "hog" not in aeng.engine.aborted
    assert aeng.metrics.sample("dsv41:request_success_total", {"finished_reason": "queue_timeout"}) == 1
    assert aeng.metrics.sample("dsv41:request_queue_time_seconds_count") == 1  # the hog's; the late one never left
