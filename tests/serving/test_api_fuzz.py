"""Malformed requests from hypothesis: each gets a 4xx with an OpenAI error body, and the server stays healthy.

Every generated request is invalid by construction: raw bytes that are not a JSON object, or a valid base
request with one to three fields replaced by a value that field cannot take.
"""

from __future__ import annotations

import http.client
import json

from serving_helpers import MODEL, get, post
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 20, 10 ** 20),
                          st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
_json = st.recursive(_json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=12)
_not_int = st.one_of(st.text(max_size=5), st.floats(0.1, 5.5).filter(lambda x: not x.is_integer()), st.booleans(),
                     st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                          max_size=2))
_not_num = st.one_of(st.text(max_size=5), st.booleans(), st.lists(st.integers(), max_size=2))

# field -> values it can never take (for both endpoints)
COMMON_BAD = {
    "model": st.one_of(st.integers(), st.lists(st.text(), max_size=2), st.sampled_from(["gpt-4o", "", "TINY"])),
    "max_tokens": st.one_of(_not_int, st.integers(-10 ** 6, 0), st.integers(10 ** 6, 10 ** 12)),
    "temperature": st.one_of(_not_num, st.floats(-1e9, -1e-3), st.floats(100.5, 1e9)),
    "top_p": st.one_of(_not_num, st.floats(-5, 0), st.floats(1.001, 50)),
    "top_k": st.one_of(_not_int, st.integers(-10 ** 6, -2)),
    "n": st.one_of(st.integers(2, 100), st.integers(-5, 0), _not_int),
    "seed": st.one_of(st.text(max_size=4), st.integers(2 ** 64, 2 ** 70), st.integers(-(2 ** 70), -(2 ** 63) - 1)),
    "stop": st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=3),
                      st.lists(st.text(min_size=1, max_size=3), min_size=17, max_size=20),
                      st.dictionaries(st.text(max_size=3), st.text(max_size=3), min_size=1, max_size=2)),
    "stream": st.one_of(st.text(max_size=3), st.integers(), st.lists(st.booleans(), max_size=2)),
    "stream_options": st.one_of(st.text(max_size=3), st.integers(),
                                st.just({"include_usage": "yes"})),
    "presence_penalty": st.one_of(st.floats(0.1, 2.0), st.floats(3.0, 1e6), _not_num),
    "frequency_penalty": st.one_of(st.floats(-2.0, -0.1), _not_num),
    "logit_bias": st.dictionaries(st.text(min_size=1, max_size=3), st.integers(-100, 100), min_size=1, max_size=2),
    "stop_token_ids": st.one_of(st.text(max_size=3), st.lists(st.integers(10 ** 6, 10 ** 9), min_size=1,
                                                              max_size=2)),
    "ignore_eos": st.one_of(st.integers(), st.text(max_size=3)),
    "user": st.one_of(st.integers(), st.lists(st.text(), max_size=2)),
}
COMPLETION_BAD = {
    **COMMON_BAD,
    "prompt": st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.just([]), st.booleans(),
                        st.lists(st.integers(10 ** 6, 10 ** 9), min_size=1, max_size=3),
                        st.lists(st.integers(-10 ** 9, -1), min_size=1, max_size=3),
                        st.lists(st.text(max_size=4), min_size=2, max_size=4),
                        st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
                        st.just("word " * 3000)),
    "echo": st.just(True),
    "best_of": st.integers(2, 10),
    "suffix": st.text(min_size=1, max_size=5),
    "logprobs": st.integers(0, 5),
}
_bad_message = st.one_of(
    st.integers(), st.text(max_size=5), st.just(None),
    st.fixed_dictionaries({"role": st.sampled_from(["robot", "", "USER", "function"]), "content": st.text(max_size=5)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(st.integers(), st.booleans(),
                                                                         st.dictionaries(st.text(max_size=2),
                                                                                         st.integers(), max_size=2))}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.one_of(st.integers(), st.fixed_dictionaries({"type": st.sampled_from(["audio", "video", "x"])}),
                  st.fixed_dictionaries({"type": st.just("text"), "text": st.integers()})), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.just("x"),
                           "tool_calls": st.one_of(st.text(max_size=3), st.lists(st.integers(), min_size=1,
                                                                                 max_size=2))}),
)
CHAT_BAD = {
    **COMMON_BAD,
    "messages": st.one_of(st.none(), st.just([]), st.text(max_size=5), st.integers(),
                          st.lists(_bad_message, min_size=1, max_size=3),
                          st.just([{"role": "user", "content": "word " * 3000}])),
    "tools": st.one_of(st.text(max_size=3), st.integers(),
                       st.lists(st.one_of(st.integers(), st.just({"type": "function"}),
                                          st.just({"type": "function", "function": {"name": 5}}),
                                          st.just({"type": "retrieval", "function": {"name": "f"}})),
                                min_size=1, max_size=2)),
    "tool_choice": st.one_of(st.sampled_from(["required", "any", ""]), st.integers(),
                             st.just({"type": "function", "function": {"name": "f"}})),
    "reasoning_effort": st.one_of(st.sampled_from(["ultra", "LOW", ""]), st.integers(-5, 0),
                                  st.integers(101, 1000), st.booleans(), st.lists(st.text(), max_size=1)),
    "chat_template_kwargs": st.one_of(st.text(max_size=3), st.integers(),
                                      st.fixed_dictionaries({"thinking": st.one_of(st.text(max_size=3),
                                                                                   st.integers())})),
    "logprobs": st.just(True),
    "top_logprobs": st.integers(1, 20),
    "response_format": st.one_of(st.just({"type": "json_object"}), st.text(max_size=3)),
    "max_completion_tokens": st.one_of(_not_int, st.integers(-100, 0)),
}

BASE = {"/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 2},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                                 "max_tokens": 2}}


@st.composite
def malformed(draw):
    path = draw(st.sampled_from(sorted(BASE)))
    kind = draw(st.sampled_from(["field", "field", "field", "field", "bytes", "json"]))
    if kind == "bytes":
        raw = draw(st.binary(max_size=60).filter(lambda b: not b.strip().startswith(b"{")))
        return path, raw
    if kind == "json":
        value = draw(_json.filter(lambda v: not isinstance(v, dict)))
        return path, json.dumps(value).encode()
    table = COMPLETION_BAD if path == "/v1/completions" else CHAT_BAD
    body = dict(BASE[path])
    for field in draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=3, unique=True)):
        body[field] = draw(table[field])
    return path, json.dumps(body).encode()


def test_malformed_requests_get_4xx_and_server_stays_healthy(fake_server):
    conn = http.client.HTTPConnection(fake_server.host, fake_server.port, timeout=60)
    statuses: list[int] = []

    @given(malformed())
    @settings(max_examples=250, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    def check(case):
        path, raw = case
        code, headers, err = post(fake_server, path, raw=raw, conn=conn)
        statuses.append(code)
        assert 400 <= code < 500, (code, raw[:300], err)
        assert isinstance(err, dict) and set(err["error"]) == {"message", "type", "param", "code"}, err

    try:
        check()
    finally:
        conn.close()
    assert len(statuses) >= 200
    assert get(fake_server, "/health")[0] == 200
    code, _, ok = post(fake_server, "/v1/completions", BASE["/v1/completions"])
    assert code == 200 and ok["usage"]["completion_tokens"] >= 1
