"""V4.1 chat encoding against fixtures, completion parsing (whole and streamed), and round trips."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from dsv41 import chat
from dsv41 import tokenizer as T

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "chat"
PROMPT_CASES = sorted(p for p in FIXTURES.glob("*.json") if p.name != "completions.json")
COMPLETIONS = json.loads((FIXTURES / "completions.json").read_text(encoding="utf-8"))["cases"]


def _case(path: pathlib.Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _calls(parsed: chat.ParsedCompletion) -> list[dict]:
    return [{"name": c.name, "arguments": json.loads(c.arguments_json)} for c in parsed.tool_calls]


def _chunkings(text: str, seed: int) -> list[list[str]]:
    """The text one character at a time, and in random-length pieces."""
    rng = np.random.default_rng(seed)
    pieces, i = [], 0
    while i < len(text):
        n = int(rng.integers(1, 9))
        pieces.append(text[i:i + n])
        i += n
    return [list(text), pieces]


# ---- encoding ------------------------------------------------------------------------------------


def test_fixture_set_is_present():
    names = {p.stem for p in PROMPT_CASES}
    assert {"official_chat", "official_thinking_low", "official_tool_call_history",
            "official_structured_image", "official_literal_image_marker"} <= names
    assert len(PROMPT_CASES) >= 15


@pytest.mark.parametrize("path", PROMPT_CASES, ids=lambda p: p.stem)
def test_encode_fixture(path):
    case = _case(path)
    if "error" in case:
        with pytest.raises(chat.ChatFormatError, match=case["error"]):
            chat.encode_chat(case["messages"], **case["kwargs"])
        return
    assert chat.encode_chat(case["messages"], **case["kwargs"]) == case["prompt"]


@pytest.mark.parametrize("path", [p for p in PROMPT_CASES if "error" not in _case(p)], ids=lambda p: p.stem)
def test_fixture_prompts_tokenize_with_single_special_ids(path):
    tok = T.load_tokenizer()
    prompt = _case(path)["prompt"]
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id and tok.decode(ids) == prompt
    for marker in (chat.USER, chat.ASSISTANT, chat.SYSTEM, chat.EOS):
        assert ids.count(tok.token_to_id(marker)) == prompt.count(marker)


def test_effort_presets():
    one = [{"role": "user", "content": "x"}]
    for effort, n in (("low", 50), ("high", 75), ("max", 100), (None, 75), (1, 1), (100, 100)):
        assert f"Reasoning Effort: {n} (range 1-100," in chat.encode_chat(one, thinking=True, reasoning_effort=effort)
    # chat mode never carries the effort line, but still rejects a bad value
    assert "Reasoning Effort" not in chat.encode_chat(one, reasoning_effort="max")
    for bad in ("medium", 101, True, 2.5):
        with pytest.raises(chat.ChatFormatError, match="reasoning_effort"):
            chat.encode_chat(one, reasoning_effort=bad)


def test_tool_call_argument_errors():
    def enc(arguments):
        return chat.encode_chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": arguments}}]}])

    assert 'string="false">[1, 2]<' in enc({"a": [1, 2]})
    assert enc("") == enc({}) and enc("{}") == enc({})
    with pytest.raises(chat.ChatFormatError, match="not valid JSON"):
        enc("{oops")
    with pytest.raises(chat.ChatFormatError, match="JSON object"):
        enc("[1, 2]")


def test_input_not_mutated():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "tool", "tool_call_id": "x", "content": "t"}, {"role": "user", "content": "q2"}]
    before = json.dumps(msgs)
    chat.encode_chat(msgs, thinking=True, tools=[{"type": "function", "function": {"name": "f"}}])
    assert json.dumps(msgs) == before


# ---- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", COMPLETIONS, ids=lambda c: c["name"])
def test_parse_fixture(case):
    exp = case["expected"]
    whole = chat.parse_completion(case["text"], thinking=case["thinking"])
    assert whole.reasoning_content == exp["reasoning_content"]
    assert whole.content == exp["content"]
    assert _calls(whole) == exp["tool_calls"]
    for chunks in _chunkings(case["text"], seed=len(case["text"])):
        streamed = chat.parse_stream(chunks, thinking=case["thinking"])
        assert (streamed.reasoning_content, streamed.content, _calls(streamed)) == \
            (whole.reasoning_content, whole.content, _calls(whole))


def test_stream_holds_back_partial_tags():
    p = chat.ChatStreamParser(thinking=False)
    assert p.feed("Hello <｜DS").content == "Hello"  # " <｜DS" might open a tool block
    assert p.feed("ML｜ calls>\n").content == ""  # it did: the separator space is dropped
    d = p.feed('<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">x</｜DSML｜ parameter>\n'
               '</｜DSML｜ inv')
    assert not d  # a call is emitted only once its invoke closes
    d = p.feed("oke>\n</｜DSML｜ calls>")
    assert [c.name for c in d.tool_calls] == ["f"] and json.loads(d.tool_calls[0].arguments_json) == {"a": "x"}
    assert p.feed(" after \n").content == " after"  # trailing whitespace waits: a tool block may follow
    assert p.finish().content == " \n"

    p = chat.ChatStreamParser(thinking=True)
    assert p.feed("plan </thi").reasoning == "plan "
    d = p.feed("nk>Answer")
    assert (d.reasoning, d.content) == ("", "Answer")


def test_tool_call_ids_and_openai_form():
    text = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>\n'
            '<｜DSML｜ invoke name="g">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    parsed = chat.parse_completion(text, thinking=False)
    assert len({c.id for c in parsed.tool_calls}) == 2 and all(c.id.startswith("call_") for c in parsed.tool_calls)
    counter = iter(range(10))
    parsed = chat.parse_completion(text, thinking=False, new_call_id=lambda: f"id{next(counter)}")
    assert chat.tool_calls_to_openai(parsed.tool_calls) == [
        {"id": "id0", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "id1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]


def test_unterminated_tool_block_keeps_complete_calls():
    text = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
            '<｜DSML｜ parameter name="n" string="false">1</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
            '<｜DSML｜ invoke name="g">\n<｜DSML｜ parameter name="n" st')
    parsed = chat.parse_completion(text, thinking=False)
    assert _calls(parsed) == [{"name": "f", "arguments": {"n": 1}}] and parsed.content == ""


# ---- round trips ---------------------------------------------------------------------------------

ROUND_TRIP = [
    (False, {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "search", "arguments": json.dumps(
            {"q": "jax <pallas> \"kernels\"", "k": 5, "filters": {"lang": ["en", "fr"], "safe": True}, "x": None})}},
        {"id": "b", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]}),
    (True, {"role": "assistant", "content": "Final answer:\n\n42", "reasoning_content": "6 * 7 = 42.\nCheck: yes."}),
    (True, {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": {"key": "多语言 ✓", "n": -1.5}}}]}),
    (False, {"role": "assistant", "content": "plain <b>html</b> and a < b"}),
]


@pytest.mark.parametrize("thinking,msg", ROUND_TRIP)
def test_round_trip(thinking, msg):
    """What the encoder writes for an assistant turn parses back to that turn."""
    prompt = chat.encode_chat([{"role": "user", "content": "q"}, msg], thinking=thinking)
    header = chat.ASSISTANT + (chat.THINK_START if thinking else chat.THINK_END)
    generated = prompt.split(header, 1)[1]
    assert generated.endswith(chat.EOS)
    want_calls = [{"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]
                   if isinstance(tc["function"]["arguments"], dict) else json.loads(tc["function"]["arguments"])}
                  for tc in msg.get("tool_calls", [])]
    want = (msg.get("reasoning_content") if thinking else None, msg["content"], want_calls)
    parsed = chat.parse_completion(generated, thinking=thinking)
    assert (parsed.reasoning_content, parsed.content, _calls(parsed)) == want
    # the same through the tokenizer, streamed token by token as serving will do it
    tok = T.load_tokenizer()
    dec, parser = tok.decode_stream(), chat.ChatStreamParser(thinking=thinking)
    deltas = [parser.feed(dec.feed(i)) for i in tok.encode(generated)]
    deltas += [parser.feed(dec.flush()), parser.finish()]
    streamed = chat.ParsedCompletion(
        reasoning_content="".join(d.reasoning for d in deltas) if parser.saw_reasoning else None,
        content="".join(d.content for d in deltas),
        tool_calls=tuple(c for d in deltas for c in d.tool_calls))
    assert (streamed.reasoning_content, streamed.content, _calls(streamed)) == want
