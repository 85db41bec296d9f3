"""The response side without a server: DSML tool calls and thinking text through the response builders, stop
strings, the token -> text pipeline."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.tokenizer import load_tokenizer
from serving.response import (ChatChunker, StopMatcher, TextPipeline, chat_completion_body, finish_reason_of,
                              usage_of)

DSML_TEXT = ('I will look it up.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
             '<｜DSML｜ invoke name="get_time">\n<｜DSML｜ parameter name="tz" string="true">CET</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>')


def _body(text: str, thinking: bool, reason: str = "stop") -> dict:
    return chat_completion_body(request_id="chatcmpl-1", model="tiny", created=0, text=text, thinking=thinking,
                                engine_finish_reason=reason, stopped_by_string=False, usage=usage_of(10, 5, 4))


def test_tool_calls_become_openai_tool_calls():
    body = _body(DSML_TEXT, thinking=False)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "I will look it up."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in msg["tool_calls"])
    assert "reasoning_content" not in msg
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 4}}


def test_tool_calls_only_has_null_content_and_length_keeps_length():
    text = DSML_TEXT[DSML_TEXT.index("<｜DSML｜ calls>"):]
    msg = _body(text, thinking=False)["choices"][0]["message"]
    assert msg["content"] is None and len(msg["tool_calls"]) == 2
    assert _body(text, thinking=False, reason="length")["choices"][0]["finish_reason"] == "length"


def test_thinking_splits_reasoning_from_content():
    msg = _body("Let me think about it.</think>The answer is 4.<｜end▁of▁sentence｜>", thinking=True)["choices"][0]
    assert msg["finish_reason"] == "stop"
    assert msg["message"]["reasoning_content"] == "Let me think about it."
    assert msg["message"]["content"] == "The answer is 4."


def test_thinking_then_tool_call():
    msg = _body("Need weather.</think>" + DSML_TEXT, thinking=True)["choices"][0]["message"]
    assert msg["reasoning_content"] == "Need weather."
    assert msg["content"] == "I will look it up." and len(msg["tool_calls"]) == 2


@given(st.lists(st.integers(1, 12), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_streamed_chunks_add_up_to_the_whole_response(cuts):
    text = "Hmm, weather.</think>" + DSML_TEXT
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i:i + c])
        i += c
    pieces.append(text[i:])
    chunker = ChatChunker(request_id="x", model="tiny", created=0, thinking=True)
    chunks = [c for p in pieces for c in chunker.feed(p)] + chunker.feed("", final=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm, weather."
    assert "".join(d.get("content", "") for d in deltas) == "I will look it up."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert chunker.final("tool_calls")["choices"][0]["finish_reason"] == "tool_calls"


@given(st.text(alphabet="abSTOP ", max_size=40), st.lists(st.text(alphabet="abSTOP", min_size=1, max_size=4),
                                                       max_size=3), st.lists(st.integers(1, 5), max_size=20))
@settings(max_examples=200, deadline=None)
def test_stop_matcher_cuts_at_the_first_stop(text, stops, cuts):
    m = StopMatcher(tuple(stops))
    out, i = [], 0
    for c in cuts:
        out.append(m.feed(text[i:i + c]))
        i += c
    out.append(m.feed(text[i:]))
    out.append(m.flush())
    got = "".join(out)
    assert text.startswith(got)
    assert not any(s in got for s in stops)  # nothing after a complete stop string leaks
    if m.stopped:  # cut right before a stop string (the first to complete, when stops overlap)
        assert any(text[len(got):].startswith(s) for s in stops)
    else:
        assert got == text and not any(s in text for s in stops)


def test_text_pipeline_drops_eos_and_final_stop_token():
    tok = load_tokenizer()
    ids = tok.encode("hello world, STOP here")
    pipe = TextPipeline(tok, stop=(), stop_token_ids=(tok.eos_id, ids[0]), skip_special_tokens=False)
    out = "".join(pipe.feed([i]) for i in ids[:-1])
    out += pipe.feed([ids[-1], tok.eos_id], finished=True, finish_reason="stop")
    assert out == "hello world, STOP here"
    pipe = TextPipeline(tok, stop=("STOP",), stop_token_ids=(tok.eos_id,), skip_special_tokens=False)
    out = "".join(pipe.feed([i]) for i in ids)
    assert out == "hello world, " and pipe.stopped


def test_finish_reason_mapping():
    assert finish_reason_of("length", True, False) == "stop"
    assert finish_reason_of("stop", False, True) == "tool_calls"
    assert finish_reason_of("length", False, True) == "length"
    assert finish_reason_of("abort", False, False) == "abort"
