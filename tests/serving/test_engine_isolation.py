"""The engine's own guard behind the API's range checks: a sampling value the API would refuse, sent straight to
the engine, fails (or is clamped for) its own request only; the request beside it finishes."""

from __future__ import annotations

import pytest

from serving.async_engine import EngineError, EngineStepError, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiny_server")]


@pytest.mark.parametrize("extreme", [dict(top_k=2 ** 31), dict(top_k=2 ** 63), dict(temperature=1e30),
                                     dict(seed=2 ** 64 - 1), dict(seed=-(2 ** 63))])
def test_an_extreme_sampling_value_hurts_no_other_request(tiny_server, extreme):
    aeng = tiny_server.async_engine
    prompt = [aeng.tokenizer.bos_id, 5, 6, 7]

    async def both():
        neighbour = await aeng.add(f"neighbour-{extreme}", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        try:
            bad = await aeng.add(f"extreme-{extreme}", prompt, SamplingParams(max_tokens=3, ignore_eos=True,
                                                                             **extreme))
        except EngineError:
            bad = None  # refused at the door: as good as clamped
        outs = {}
        for stream in (neighbour, bad):
            if stream is None:
                continue
            async with stream:
                try:
                    outs[stream.request_id] = [o async for o in stream]
                except EngineStepError as e:
                    outs[stream.request_id] = e
        return outs

    outs = tiny_server.run(both(), timeout_s=600)
    got = outs[f"neighbour-{extreme}"]
    assert not isinstance(got, Exception), f"the neighbour of {extreme} failed: {got}"
    assert sum(len(o.new_token_ids) for o in got) == 3
    bad = outs.get(f"extreme-{extreme}")
    assert bad is None or not isinstance(bad, Exception), f"{extreme} failed its step instead of being clamped: {bad}"
