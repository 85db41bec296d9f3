"""The OpenAI-compatible server end to end, through the unmodified `openai` client and raw HTTP.

Tests on `any_server` run on the FakeEngine-backed server and (marked slow) on the real tiny engine; scripted
output (tool calls, thinking, stop strings) and fault injection use the fake only.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import openai
import pytest
from serving_helpers import MODEL, engine_stats, get, post, sample, scrape
from fake_engine import FakeEngine

from serving.api import BackgroundServer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


# the tiny server's tests share one xdist worker, so that its programs compile once, not once a worker
@pytest.fixture(params=["fake", pytest.param("tiny", marks=[pytest.mark.slow,
                                                             pytest.mark.xdist_group("tiny_server")])])
def any_server(request):
    return request.getfixturevalue(f"{request.param}_server")


def client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _usage_ok(usage, max_tokens: int) -> None:
    assert usage.prompt_tokens > 0
    assert 1 <= usage.completion_tokens <= max_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


# ---- shapes ---------------------------------------------------------------------------------------------


def test_models_and_health(any_server):
    models = client(any_server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert get(any_server, "/health") == (200, '{"status": "ok"}')


def test_completions(any_server):
    c = client(any_server)
    r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert isinstance(r.choices[0].text, str) and r.choices[0].finish_reason in ("stop", "length")
    _usage_ok(r.usage, 3)
    chunks = list(c.completions.create(model=MODEL, prompt=[0, 5, 6, 7], max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    _usage_ok(chunks[-1].usage, 3)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_chat(any_server):
    c = client(any_server)
    msgs = [{"role": "user", "content": "Hi there"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0.7, top_p=0.9, seed=1,
                                  extra_body={"top_k": 20})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    _usage_ok(r.usage, 3)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    _usage_ok(chunks[-1].usage, 3)


def test_continuous_usage_stats(any_server):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far, which is how the bench
    counts the tokens behind a chunk when some decode to no text."""
    c = client(any_server)
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]  # a chunk may carry several tokens
    assert counts[0] >= 1 and counts == sorted(counts) and counts[-1] == 4, counts
    assert all(ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for ch in chunks)


def test_chat_thinking_shapes(any_server):
    c = client(any_server)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3,
                                  extra_body={"chat_template_kwargs": {"thinking": True}})
    assert isinstance(r.choices[0].message.model_extra.get("reasoning_content"), str)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, reasoning_effort="low")
    assert "reasoning_content" in r.choices[0].message.model_extra


def test_chat_tools_shapes(any_server):
    """The tools prompt is ~460 tokens on the tiny tokenizer: the costliest real-engine test (4 prefill chunks)."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client(any_server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    _usage_ok(r.usage, 3)
    assert r.usage.prompt_tokens > 300  # the tool schemas were rendered into the prompt


def test_concurrent_requests_past_the_slots_complete(any_server):
    """32 at once on the fake engine; the real one (2 sequences at a time) gets 12, six times its slots, as each
    of its prefills is a CPU step of ~0.5 s."""
    n = 32 if isinstance(any_server.async_engine.engine, FakeEngine) else 12

    async def main():
        c = openai.AsyncOpenAI(base_url=any_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)

        async def one(i):
            msgs = [{"role": "user", "content": f"q{i}"}]
            if i % 2:
                chunks = [ch async for ch in await c.chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=2, stream=True, stream_options={"include_usage": True})]
                return chunks[-1].usage
            return (await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)).usage

        try:
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await c.close()

    usages = asyncio.run(main())
    assert len(usages) == n
    for u in usages:
        _usage_ok(u, 2)


def test_disconnect_mid_stream_aborts_and_frees_pages(any_server):
    srv = any_server
    base = engine_stats(srv)
    calls: list[str] = []

    def spy(engine):
        orig = engine.abort

        def abort(rid):
            calls.append(rid)
            return orig(rid)

        engine.abort = abort

    srv.async_engine.call_in_engine_thread(spy)
    try:
        body = json.dumps({"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400, "stream": True,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection((srv.host, srv.port), timeout=600)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        head = b""
        while b"data:" not in head:
            data = sock.recv(4096)
            assert data, f"the server closed the stream early: {head!r}"
            head += data
        rid = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"x-request-id:"))
        sock.close()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            s = engine_stats(srv)
            if rid in calls and s["running"] == 0 and s["waiting"] == 0:
                break
            time.sleep(0.05)
        assert rid in calls, "the engine never saw abort() for the disconnected request"
        assert s["running"] == 0 and s["waiting"] == 0
        assert s["kv_pages_used"] == base["kv_pages_used"]
        assert srv.async_engine.num_in_flight == 0
    finally:
        srv.async_engine.call_in_engine_thread(lambda e: e.__dict__.pop("abort", None))
    assert get(srv, "/health")[0] == 200


def test_second_turn_reports_cached_tokens(any_server):
    srv = any_server
    if "prefix_cache_query_tokens" not in engine_stats(srv):
        pytest.skip("this engine has no prefix cache")
    c = client(srv)
    system = "You are a careful assistant. " + " ".join(f"rule {i}: be brief." for i in range(6))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "First question?"}]
    r1 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, user="session-A")
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And a follow-up?"}]
    r2 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, user="session-A")
    assert r1.usage.prompt_tokens > 64  # at least one full page of the real engine
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens


# ---- scripted output (fake engine) -------------------------------------------------------------------------


def test_tool_calls_end_to_end(fake_server):
    c = client(fake_server)
    msgs = [{"role": "user", "content": "SAY_TOOL"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200, stream=True))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Let me check."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The answer goes back in as history: the tool call and its result render into the next prompt.
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=3)
    assert r.choices[0].finish_reason == "length"


def test_thinking_end_to_end(fake_server):
    c = client(fake_server)
    msgs = [{"role": "user", "content": "SAY_THINK"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100,
                                  extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "I should greet them."
    assert m.content == "Hello there!" and r.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100, reasoning_effort="high",
                                            stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "I should greet them."
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    # without thinking the same text is all content (the </think> tag dropped)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100)
    assert r.choices[0].message.content == "I should greet them.Hello there!"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_are_trimmed_and_abort(fake_server, stream):
    c = client(fake_server)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "SAY_STOP"}], max_tokens=100, stop=["STOP", "zz"])
    if stream:
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish = chunks[-2].choices[0].finish_reason
        usage = chunks[-1].usage
    else:
        r = c.chat.completions.create(**kw)
        text, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    assert text == "alpha beta " and finish == "stop"
    assert usage.completion_tokens < len(fake_server.async_engine.tokenizer.encode(
        "alpha beta STOP gamma delta"))
    r = c.completions.create(model=MODEL, prompt="SAY_STOP", max_tokens=100, stop="beta")
    assert r.choices[0].text == "alpha " and r.choices[0].finish_reason == "stop"


def test_session_key_from_header_or_user(fake_server):
    eng = fake_server.async_engine.engine
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": "u-1"}
    _, h, _ = post(fake_server, "/v1/completions", body)
    assert eng.sessions[h["X-Request-Id"]] == "u-1"
    _, h, _ = post(fake_server, "/v1/completions", body, headers={"X-Session-Id": "hdr-7"})
    assert eng.sessions[h["X-Request-Id"]] == "hdr-7"


# ---- errors and robustness ----------------------------------------------------------------------------------


BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "word " * 2000, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": 7}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "ultra"}, 400,
     "reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_requests_get_openai_errors(fake_server, path, body, status, param):
    code, headers, err = post(fake_server, path, body)
    assert code == status, err
    assert headers["Content-Type"].startswith("application/json")
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param and err["error"]["message"]


def test_malformed_transport_errors(fake_server):
    assert post(fake_server, "/v1/completions", raw=b"{not json")[0] == 400
    assert post(fake_server, "/v1/completions", raw=b'{"prompt": NaN}')[0] == 400
    assert post(fake_server, "/v1/completions", raw=b"[1, 2]")[0] == 400
    code, _, err = post(fake_server, "/v1/nothing", {})
    assert code == 404 and err["error"]["code"] == "not_found"
    code, err = get(fake_server, "/v1/completions")
    assert code == 405 and json.loads(err)["error"]["code"] == "method_not_allowed"


def test_queue_full_is_503_with_retry_after():
    with BackgroundServer(FakeEngine(max_waiting=0), model_name=MODEL) as srv:
        code, headers, err = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert code == 503 and headers["Retry-After"] == "1"
        assert err["error"]["code"] == "queue_full"
        assert get(srv, "/health")[0] == 200
        assert sample(scrape(srv), "dsv41:requests_rejected_total", reason="queue_full") == 1


def test_one_bad_request_does_not_stop_the_others(fake_server):
    """A step failure that names its request fails that one only; one that names none fails the requests in
    flight; either way the server goes on."""
    c = client(fake_server)

    async def main():
        ac = openai.AsyncOpenAI(base_url=fake_server.base_url + "/v1", api_key="x", max_retries=0)
        try:
            good = asyncio.create_task(ac.completions.create(model=MODEL, prompt="fine", max_tokens=300,
                                                             extra_body={"ignore_eos": True}))
            await asyncio.sleep(0.05)
            with pytest.raises(openai.InternalServerError, match="injected failure"):
                await ac.completions.create(model=MODEL, prompt="POISON", max_tokens=5)
            return await good
        finally:
            await ac.close()

    r = asyncio.run(main())
    assert r.usage.completion_tokens == 300 and r.choices[0].finish_reason == "length"

    fake_server.async_engine.call_in_engine_thread(lambda e: setattr(e, "fail_next_steps", 1))
    with pytest.raises(openai.InternalServerError, match="retry the request"):
        c.completions.create(model=MODEL, prompt="unlucky", max_tokens=2)
    assert c.completions.create(model=MODEL, prompt="lucky", max_tokens=2).usage.completion_tokens == 2
    assert get(fake_server, "/health")[0] == 200


def test_metrics_endpoint(fake_server):
    client(fake_server).completions.create(model=MODEL, prompt="count me", max_tokens=3)
    m = scrape(fake_server)
    assert sample(m, "dsv41:time_to_first_token_seconds_count") >= 1
    assert sample(m, "dsv41:inter_token_latency_seconds_count") >= 1
    assert sample(m, "dsv41:request_queue_time_seconds_count") >= 1
    assert sample(m, "dsv41:generation_tokens_total") >= 3 and sample(m, "dsv41:prompt_tokens_total") >= 1
    assert sample(m, "dsv41:requests_started_total", endpoint="completions") >= 1
    assert sample(m, "dsv41:http_requests_total", route="/v1/completions", status="200") >= 1
    assert sample(m, "dsv41:prefix_cache_queries_total") >= 1
    for name in ("dsv41:kv_cache_usage_perc", "dsv41:kv_cache_pages_total", "dsv41:num_requests_waiting",
                 "dsv41:num_requests_running", "dsv41:num_preemptions"):
        assert name in m, name


def test_step_failure_before_the_first_token_is_a_500(fake_server):
    """A streamed response sends its headers with its first token, so a request that fails before it gets a
    status a client can act on."""
    code, _, err = post(fake_server, "/v1/completions", {"prompt": "POISON", "max_tokens": 5, "stream": True})
    assert code == 500 and err["error"]["code"] == "engine_step_failed"
    with pytest.raises(openai.APIError, match="injected failure"):
        list(client(fake_server).completions.create(model=MODEL, prompt="POISON", max_tokens=5, stream=True))


def test_step_failure_mid_stream_ends_the_stream_with_an_error_event(fake_server):
    conn = http.client.HTTPConnection(fake_server.host, fake_server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "long one", "max_tokens": 900, "stream": True,
                                                        "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200  # the headers went out with the first token
    resp.readline()
    fake_server.async_engine.call_in_engine_thread(lambda e: setattr(e, "fail_next_steps", 1))
    events = [line[len(b"data: "):].strip() for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
    conn.close()
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_step_failed"
    deadline = time.monotonic() + 10  # healthy again once the engine is idle
    while get(fake_server, "/health")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert get(fake_server, "/health")[0] == 200
