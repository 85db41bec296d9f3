"""The response side: token ids -> text (StreamDecoder, special tokens, stop strings) -> OpenAI bodies and chunks.

Per request: ids -> TextPipeline (drops EOS and special tokens, holds back text that may begin a stop string)
-> completions: the text; chat: ChatChunker / chat_completion_body (reasoning, content, tool calls).
"""

from __future__ import annotations

import json
from typing import Any

from dsv41 import chat as chat_format

# Tags the chat parser reads to split reasoning and tool calls out of the text: kept in the ids it sees even when
# special tokens are skipped (a tokenizer may flag them special), and never shown (the parser consumes them).
_PARSER_TAGS = (chat_format.THINK_START, chat_format.THINK_END, chat_format.DSML)


class StopMatcher:
    """Cuts generated text at the first stop string; holds back a tail that may be the start of one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.stopped = False
        self._buf = ""

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._buf + text
        hits = [at for at in (buf.find(s) for s in self.stops) if at >= 0]
        if hits:
            self.stopped = True
            self._buf = ""
            return buf[: min(hits)]
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._buf = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out


class TextPipeline:
    """Token ids -> final text, cut at stop strings. EOS and (at a 'stop' finish) the final stop token are not
    rendered as text; with skip_special_tokens, no special token is (role markers, BOS, image placeholders), but
    the chat parser's tags still reach it when `chat`."""

    def __init__(self, tokenizer: Any, *, stop: tuple[str, ...], stop_token_ids: tuple[int, ...],
                 skip_special_tokens: bool, chat: bool = False) -> None:
        self._decoder = tokenizer.decode_stream(skip_special_tokens=False)
        self._stop = StopMatcher(stop)
        self._stop_ids = frozenset(stop_token_ids)
        drop = {tokenizer.eos_id}
        if skip_special_tokens:
            keep = {tokenizer.token_to_id(t) for t in _PARSER_TAGS} if chat else set()
            drop |= set(tokenizer.special_ids) - keep
        self._drop = frozenset(drop)

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def feed(self, ids: list[int], *, finished: bool = False, finish_reason: str | None = None) -> str:
        if finished and finish_reason == "stop" and ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        ids = [i for i in ids if i not in self._drop]
        text = self._stop.feed(self._decoder.feed(ids)) if ids else ""
        if finished:
            text += self._stop.feed(self._decoder.flush())
            text += self._stop.flush()
        return text


def finish_reason_of(engine_reason: str | None, stopped_by_string: bool, tool_calls: bool) -> str | None:
    reason = "stop" if stopped_by_string else engine_reason
    return "tool_calls" if tool_calls and reason == "stop" else reason


def usage_of(num_prompt: int, num_generated: int, num_cached: int) -> dict[str, Any]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_generated, "total_tokens": num_prompt + num_generated,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def chat_message_from_text(text: str, *, thinking: bool) -> tuple[dict[str, Any], bool]:
    """The assistant message (OpenAI shape) for a whole generated text, and whether it holds tool calls."""
    parsed = chat_format.parse_completion(text, thinking=thinking)
    return _message(parsed.reasoning_content, parsed.content, list(parsed.tool_calls)), bool(parsed.tool_calls)


def _message(reasoning: str | None, content: str, calls: list[chat_format.ToolCall]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
    return msg


def chat_completion_body(*, request_id: str, model: str, created: int, text: str, thinking: bool,
                         engine_finish_reason: str | None, stopped_by_string: bool,
                         usage: dict[str, Any]) -> dict[str, Any]:
    """The non-streaming /v1/chat/completions response for a whole generated text."""
    message, has_calls = chat_message_from_text(text, thinking=thinking)
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason_of(engine_finish_reason, stopped_by_string, has_calls)}],
            "usage": usage}


class ChatChunker:
    """Streaming /v1/chat/completions chunks from text deltas (one per request)."""

    def __init__(self, *, request_id: str, model: str, created: int, thinking: bool) -> None:
        self._parser = chat_format.ChatStreamParser(thinking=thinking)
        self._head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._sent_role = False
        self.num_tool_calls = 0

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**self._head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish_reason}]}

    def feed(self, text: str, *, final: bool = False) -> list[dict[str, Any]]:
        out = []
        if not self._sent_role:
            out.append(self._chunk({"role": "assistant", "content": ""}))
            self._sent_role = True
        deltas = [self._parser.feed(text)] if text else []
        if final:
            deltas.append(self._parser.finish())
        for d in deltas:
            delta: dict[str, Any] = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.content:
                delta["content"] = d.content
            if d.tool_calls:
                delta["tool_calls"] = [{"index": self.num_tool_calls + k, **c.to_openai()}
                                       for k, c in enumerate(d.tool_calls)]
                self.num_tool_calls += len(d.tool_calls)
            if delta:
                out.append(self._chunk(delta))
        return out

    def final(self, finish_reason: str | None) -> dict[str, Any]:
        return self._chunk({}, finish_reason)

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": usage}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
