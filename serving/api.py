"""OpenAI-compatible HTTP server (aiohttp) over an `AsyncEngine`.

Routes: GET /health, GET /metrics (Prometheus text), GET /v1/models[/{id}], POST /v1/completions,
POST /v1/chat/completions (both streaming as SSE `data: {...}` chunks ending in `data: [DONE]`, or not).

Request fields: model, max_tokens (chat also max_completion_tokens), temperature, top_p, top_k (vLLM extension;
-1 or 0 = off), seed, stop (string or list: generation stops there, the stop text is not returned),
stop_token_ids and ignore_eos (vLLM extensions), n (1 only), stream, stream_options.include_usage and
.continuous_usage_stats (vLLM's: every streamed chunk carries the usage so far), user (kept as the session key;
an `X-Session-Id` header wins over it). Chat adds messages, tools, tool_choice (auto/none),
reasoning_effort and chat_template_kwargs ({"thinking": true} or {"enable_thinking": true}): thinking mode
returns `reasoning_content` apart from `content`; DSML tool calls come back as OpenAI `tool_calls` with
finish_reason "tool_calls". usage carries prompt_tokens_details.cached_tokens (the prefix-cache hit).

Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for bad input (malformed JSON,
wrong types, out-of-range values, a prompt over max_model_len), 404 for an unknown model or route, 503 with
Retry-After when the engine's waiting queue is full. A bad request never affects the others.

Text pipeline per request: token ids -> StreamDecoder -> StopMatcher (holds back text that may begin a stop
string) -> completions: the text; chat: ChatStreamParser (reasoning / content / tool calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from typing import Any, Callable

from aiohttp import web

from dsv41 import chat as chat_format
from serving.async_engine import (AsyncEngine, EngineDead, EngineError, EngineStepError, QueueFull,
                                  RequestStream, SamplingParams)
from serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_STOP_STRINGS = 16
RETRY_AFTER_S = 1
_TOKENIZE_OFF_LOOP_BYTES = 64 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
# OpenAI reasoning_effort names that the V4.1 presets lack, mapped onto the nearest preset.
_EFFORT_ALIASES = {"minimal": "low", "medium": "high", "xhigh": "max"}
_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


class ApiError(Exception):
    """An error answered as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- request validation ---------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, NaN/Infinity, absurd nesting
        raise _bad(f"the request body is not valid JSON ({e}); send a JSON object", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


class _Fields:
    """Typed access to the body's fields; every failure is a 400 that names the field."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def int(self, name: str, default: int | None, *, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise _bad(f"{name} must be an integer, got {_type_name(v)} {v!r}"[:300], name, "invalid_type")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise _bad(f"{name} must be {rng}, got {v}", name)
        return v

    def float(self, name: str, default: float, *, lo: float, hi: float, lo_open: bool = False) -> float:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _bad(f"{name} must be a number, got {_type_name(v)} {v!r}"[:300], name, "invalid_type")
        v = float(v)
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            raise _bad(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
        return v

    def bool(self, name: str, default: bool) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _bad(f"{name} must be true or false, got {_type_name(v)} {v!r}"[:300], name, "invalid_type")
        return v

    def str(self, name: str) -> str | None:
        v = self.body.get(name)
        if v is not None and not isinstance(v, str):
            raise _bad(f"{name} must be a string, got {_type_name(v)}", name, "invalid_type")
        return v

    def obj(self, name: str) -> dict[str, Any] | None:
        v = self.body.get(name)
        if v is not None and not isinstance(v, dict):
            raise _bad(f"{name} must be an object, got {_type_name(v)}", name, "invalid_type")
        return v

    def unsupported(self, name: str, ok: Callable[[Any], bool], what: str) -> None:
        v = self.body.get(name)
        if v is not None and not ok(v):
            raise _bad(f"{name}={v!r} is not supported by this server; {what}"[:400], name, "unsupported")


@dataclasses.dataclass(frozen=True)
class GenRequest:
    """A validated generation request, ready for the engine."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    session: str | None
    chat: bool = False
    continuous_usage: bool = False
    thinking: bool = False


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_id: int
    bos_id: int


def _common(f: _Fields, cfg: ServerConfig, prompt_ids: list[int], *, chat: bool,
            session_header: str | None
            ) -> tuple[SamplingParams, tuple[str, ...], bool, tuple[bool, bool], str | None]:
    n_prompt = len(prompt_ids)
    prompt_param = "messages" if chat else "prompt"
    if n_prompt == 0:
        raise _bad("the prompt is empty; send at least one token", prompt_param)
    if n_prompt >= cfg.max_model_len:
        raise _bad(f"this model's maximum context length is {cfg.max_model_len} tokens, but the prompt has "
                   f"{n_prompt} tokens; shorten the prompt", prompt_param, "context_length_exceeded")
    f.int("n", 1, lo=1)
    if f.body.get("n") not in (None, 1):
        raise _bad(f"n={f.body['n']}: this server returns one choice per request (n=1); send separate requests",
                   "n", "unsupported")
    max_tokens = f.int("max_tokens", None, lo=1)
    if chat:
        mct = f.int("max_completion_tokens", None, lo=1)
        max_tokens = mct if max_tokens is None else max_tokens
    room = cfg.max_model_len - n_prompt
    if max_tokens is None:
        max_tokens = room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    if max_tokens > room:
        raise _bad(f"this model's maximum context length is {cfg.max_model_len} tokens; the request has "
                   f"{n_prompt} prompt tokens and asks for {max_tokens} completion tokens "
                   f"({n_prompt + max_tokens} in all); lower max_tokens to at most {room} or shorten the prompt",
                   "max_tokens", "context_length_exceeded")
    temperature = f.float("temperature", 1.0, lo=0.0, hi=100.0)
    top_p = f.float("top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = f.int("top_k", 0, lo=-1)
    top_k = 0 if top_k == -1 else top_k
    seed = f.int("seed", None, lo=-(2 ** 63), hi=2 ** 64 - 1)
    for name in ("presence_penalty", "frequency_penalty"):
        f.float(name, 0.0, lo=-2.0, hi=2.0)
        f.unsupported(name, lambda v: v == 0, "leave it at 0")
    f.float("repetition_penalty", 1.0, lo=0.0, hi=100.0, lo_open=True)
    f.unsupported("repetition_penalty", lambda v: v == 1, "leave it at 1")
    f.unsupported("logit_bias", lambda v: v == {}, "leave it out")
    stop_raw = f.body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        if len(stop_raw) > MAX_STOP_STRINGS:
            raise _bad(f"stop has {len(stop_raw)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        stop = tuple(s for s in stop_raw if s)
    else:
        raise _bad("stop must be a string or an array of strings", "stop", "invalid_type")
    stop_ids_raw = f.body.get("stop_token_ids")
    if stop_ids_raw is None:
        stop_ids: tuple[int, ...] = ()
    elif (isinstance(stop_ids_raw, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids_raw)
          and all(0 <= i < cfg.vocab_size for i in stop_ids_raw)):
        stop_ids = tuple(stop_ids_raw)
    else:
        raise _bad(f"stop_token_ids must be an array of token ids in [0, {cfg.vocab_size})", "stop_token_ids")
    ignore_eos = f.bool("ignore_eos", False)
    stream = f.bool("stream", False)
    opts = f.obj("stream_options") or {}
    include_usage = opts.get("include_usage", False)
    continuous_usage = opts.get("continuous_usage_stats", False)
    for name, value in (("include_usage", include_usage), ("continuous_usage_stats", continuous_usage)):
        if not isinstance(value, bool):
            raise _bad(f"stream_options.{name} must be true or false", "stream_options", "invalid_type")
    if opts and not stream:
        raise _bad("stream_options is only allowed with stream=true", "stream_options")
    user = f.str("user")
    session = session_header or user or None
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=seed, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    return sampling, stop, stream, (include_usage, continuous_usage), session


def check_model(f: _Fields, cfg: ServerConfig) -> None:
    model = f.str("model")
    if model is not None and model != cfg.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {cfg.model_name!r} "
                            "(see GET /v1/models)", param="model", code="model_not_found")


def parse_completion_request(body: dict[str, Any], cfg: ServerConfig, tokenizer: Any,
                             session_header: str | None = None) -> GenRequest:
    f = _Fields(body)
    check_model(f, cfg)
    f.unsupported("echo", lambda v: v is False, "leave it false")
    f.unsupported("best_of", lambda v: v == 1, "leave it at 1")
    f.unsupported("suffix", lambda v: False, "leave it out")
    f.unsupported("logprobs", lambda v: False, "leave it out (logprobs are not returned)")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
        if not ids or ids[0] != cfg.bos_id:
            ids = [cfg.bos_id, *ids]
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        bad = [i for i in prompt if not 0 <= i < cfg.vocab_size]
        if bad:
            raise _bad(f"prompt token ids must be in [0, {cfg.vocab_size}); got {bad[:5]}", "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad(f"prompt is a batch of {len(prompt)} prompts; send one prompt per request", "prompt",
                   "unsupported")
    else:
        raise _bad("prompt must be a string, an array of token ids, or an array holding one of those",
                   "prompt", "invalid_type")
    sampling, stop, stream, (usage, continuous), session = _common(f, cfg, ids, chat=False,
                                                                   session_header=session_header)
    return GenRequest(ids, sampling, stop, stream, usage, session, continuous_usage=continuous)


def _thinking_options(f: _Fields) -> tuple[bool, int | str | None]:
    ctk = f.obj("chat_template_kwargs") or {}
    thinking = ctk.get("thinking", ctk.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise _bad("chat_template_kwargs.thinking must be true or false", "chat_template_kwargs", "invalid_type")
    effort = f.body.get("reasoning_effort", ctk.get("reasoning_effort"))
    if effort is not None:
        if isinstance(effort, bool) or not isinstance(effort, (str, int)):
            raise _bad("reasoning_effort must be a string (low, medium, high, max, none) or an integer in "
                       "[1, 100]", "reasoning_effort", "invalid_type")
        if effort == "none":
            return False if thinking is None else thinking, None
        effort = _EFFORT_ALIASES.get(effort, effort) if isinstance(effort, str) else effort
    if thinking is None:
        thinking = effort is not None
    return thinking, effort


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty array of message objects", "messages", "invalid_type")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object, got {_type_name(m)}", "messages", "invalid_type")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or ("text" in part and not isinstance(part["text"], (str, type(None)))):
                    raise _bad(f"messages[{i}].content[{j}] must be a content part object with a string text",
                               "messages", "invalid_type")
        elif content is not None and not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string, an array of parts or null, got "
                       f"{_type_name(content)}", "messages", "invalid_type")
        for key in ("reasoning_content", "name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise _bad(f"messages[{i}].{key} must be a string", "messages", "invalid_type")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise _bad(f"messages[{i}].tool_calls must be an array of tool call objects", "messages", "invalid_type")


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _bad("tools must be an array of tool definitions", "tools", "invalid_type")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools",
                       "invalid_type")
        if t.get("type", "function") != "function":
            raise _bad(f"tools[{i}].type {t.get('type')!r}: only function tools are supported", "tools", "unsupported")


def parse_chat_request(body: dict[str, Any], cfg: ServerConfig, tokenizer: Any,
                       session_header: str | None = None) -> GenRequest:
    f = _Fields(body)
    check_model(f, cfg)
    f.unsupported("logprobs", lambda v: v is False, "leave it out (logprobs are not returned)")
    f.unsupported("top_logprobs", lambda v: v == 0, "leave it out")
    f.unsupported("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
                  "only {\"type\": \"text\"} is supported (no guided decoding)")
    messages = body.get("messages")
    _check_messages(messages)
    tools = body.get("tools")
    _check_tools(tools)
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise _bad(f"tool_choice={tool_choice!r}"[:200] + ": only \"auto\" and \"none\" are supported (no forced "
                   "tool calls)", "tool_choice", "unsupported")
    f.bool("parallel_tool_calls", True)
    thinking, effort = _thinking_options(f)
    try:
        text = chat_format.encode_chat(messages, thinking=thinking, reasoning_effort=effort,
                                       tools=tools if tools and tool_choice != "none" else None)
    except chat_format.ChatFormatError as e:
        param = "reasoning_effort" if "reasoning_effort" in str(e) else "messages"
        raise _bad(str(e), param) from None
    except (TypeError, AttributeError, KeyError, ValueError) as e:  # shapes the checks above let through
        log.debug("encode_chat rejected a request: %r", e)
        raise _bad(f"messages or tools could not be encoded ({type(e).__name__}: {e}); check their shape against "
                   "the OpenAI chat format"[:400], "messages") from None
    ids = tokenizer.encode(text)
    sampling, stop, stream, (usage, continuous), session = _common(f, cfg, ids, chat=True,
                                                                   session_header=session_header)
    return GenRequest(ids, sampling, stop, stream, usage, session, chat=True, thinking=thinking,
                      continuous_usage=continuous)


# ---- output text pipeline -----------------------------------------------------------------------------------


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
    rendered as text."""

    def __init__(self, tokenizer: Any, *, stop: tuple[str, ...], stop_token_ids: tuple[int, ...],
                 skip_special_tokens: bool) -> None:
        self._decoder = tokenizer.decode_stream(skip_special_tokens=skip_special_tokens)
        self._stop = StopMatcher(stop)
        self._eos = tokenizer.eos_id
        self._stop_ids = frozenset(stop_token_ids)

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def feed(self, ids: list[int], *, finished: bool = False, finish_reason: str | None = None) -> str:
        if finished and finish_reason == "stop" and ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        ids = [i for i in ids if i != self._eos]
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


# ---- server ----------------------------------------------------------------------------------------------


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class OpenAIServer:
    """The aiohttp application's state and handlers. `app` is the aiohttp Application."""

    def __init__(self, async_engine: AsyncEngine, *, model_name: str, metrics: ServingMetrics | None = None) -> None:
        self.engine = async_engine
        self.metrics = metrics or async_engine.metrics or ServingMetrics()
        if async_engine.metrics is None:
            async_engine.metrics = self.metrics
        tok = async_engine.tokenizer
        self.tokenizer = tok
        self.cfg = ServerConfig(model_name=model_name, max_model_len=async_engine.max_model_len,
                                vocab_size=tok.vocab_size, eos_id=tok.eos_id, bos_id=tok.bos_id)
        self.created = int(time.time())
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware])
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics_text)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model_id}", self.model)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)

    async def _on_startup(self, app: web.Application) -> None:
        if self.engine._thread is None:
            self.engine.start()
        log.info("serving %r (max_model_len %d)", self.cfg.model_name, self.cfg.max_model_len)

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.engine.shutdown()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            if e.status >= 500:
                log.warning("%s %s -> %d: %s", request.method, request.path, e.status, e.message)
            return e.response()
        except web.HTTPException as e:  # unknown route, wrong method, body too large
            status = e.status
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
            msg = {404: f"no route {request.path}; see {', '.join(_ROUTES)}",
                   405: f"{request.method} is not allowed on {request.path}",
                   413: f"the request body is over {MAX_BODY_BYTES} bytes"}.get(e.status, e.reason)
            return ApiError(e.status, msg, code=code, headers={k: v for k, v in e.headers.items()
                                                               if k.lower() == "allow"}).response()
        except (asyncio.CancelledError, ConnectionError):
            status = 499  # the client went away
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return ApiError(500, "internal server error; see the server log", code="internal_error").response()
        finally:
            route = request.match_info.route.resource
            path = route.canonical if route is not None else "unmatched"
            self.metrics.http_requests.inc(labels={"route": path, "method": request.method, "status": str(status)})

    # ---- simple routes ----

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.alive:
            return ApiError(503, "the engine thread is not running; restart the server",
                            code="engine_dead").response()
        if not self.engine.healthy:
            return ApiError(503, "the last engine step failed; see the server log", code="engine_unhealthy",
                            headers={"Retry-After": str(RETRY_AFTER_S)}).response()
        return web.json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        stats = await self.engine.stats(timeout_s=2.0)
        body = self.metrics.render(stats)
        return web.Response(body=body.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "dsv41",
                "root": self.cfg.model_name, "parent": None, "max_model_len": self.cfg.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model_id"] != self.cfg.model_name:
            raise ApiError(404, f"the model {request.match_info['model_id']!r} does not exist; this server serves "
                                f"{self.cfg.model_name!r}", param="model", code="model_not_found")
        return web.json_response(self._model_card())

    # ---- generation ----

    async def _admit(self, request: web.Request, parse: Callable, endpoint: str, prefix: str
                     ) -> tuple[GenRequest, RequestStream]:
        arrival = time.monotonic()
        raw = await request.read()
        session = request.headers.get("X-Session-Id") or None
        try:
            body = parse_json_body(raw)
            if len(raw) > _TOKENIZE_OFF_LOOP_BYTES:  # long prompts: keep the event loop responsive
                req = await asyncio.to_thread(parse, body, self.cfg, self.tokenizer, session)
            else:
                req = parse(body, self.cfg, self.tokenizer, session)
        except ApiError as e:
            self.metrics.requests_rejected.inc(labels={"reason": "not_found" if e.status == 404 else "invalid"})
            raise
        rid = f"{prefix}-{uuid.uuid4().hex}"
        try:
            stream = await self.engine.add(rid, req.prompt_ids, req.sampling, req.session, arrival=arrival)
        except QueueFull as e:
            self.metrics.requests_rejected.inc(labels={"reason": "queue_full"})
            raise ApiError(503, f"the server is at capacity ({e}); retry after {RETRY_AFTER_S} s",
                           code="queue_full", type="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineError as e:
            self.metrics.requests_rejected.inc(labels={"reason": "invalid"})
            raise _bad(f"the engine refused the request: {e}", code="engine_rejected") from None
        except EngineDead as e:
            self.metrics.requests_rejected.inc(labels={"reason": "engine_dead"})
            raise ApiError(503, str(e), code="engine_dead", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        self.metrics.requests_started.inc(labels={"endpoint": endpoint})
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self.metrics.prompt_len.observe(len(req.prompt_ids))
        return req, stream

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req, stream = await self._admit(request, parse_completion_request, "completions", "cmpl")
        return await self._run(request, req, stream)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req, stream = await self._admit(request, parse_chat_request, "chat_completions", "chatcmpl")
        return await self._run(request, req, stream)

    async def _run(self, request: web.Request, req: GenRequest, stream: RequestStream) -> web.StreamResponse:
        created = int(time.time())
        pipe = TextPipeline(self.tokenizer, stop=req.stop, stop_token_ids=req.sampling.stop_token_ids,
                            skip_special_tokens=not req.chat)
        async with stream:  # leaving early (disconnect, stop string, error) aborts the request in the engine
            if req.stream:
                return await self._stream(request, req, stream, pipe, created)
            parts: list[str] = []
            cached = 0
            finish = None
            try:
                async for out in stream:
                    cached = out.num_cached_tokens
                    parts.append(pipe.feed(out.new_token_ids, finished=out.finished, finish_reason=out.finish_reason))
                    finish = out.finish_reason
                    if pipe.stopped:
                        stream.abort("stop")
                        break
            except EngineStepError as e:
                raise ApiError(500, str(e), code="engine_step_failed") from None
            self.metrics.cached_prompt_tokens.inc(cached)
            usage = usage_of(len(req.prompt_ids), stream.num_generated, cached)
            text = "".join(parts)
            if req.chat:
                body = chat_completion_body(request_id=stream.request_id, model=self.cfg.model_name, created=created,
                                            text=text, thinking=req.thinking, engine_finish_reason=finish,
                                            stopped_by_string=pipe.stopped, usage=usage)
            else:
                body = {"id": stream.request_id, "object": "text_completion", "created": created,
                        "model": self.cfg.model_name,
                        "choices": [{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": finish_reason_of(finish, pipe.stopped, False)}],
                        "usage": usage}
            return web.json_response(body, dumps=lambda o: json.dumps(o, ensure_ascii=False),
                                     headers={"X-Request-Id": stream.request_id})

    async def _stream(self, request: web.Request, req: GenRequest, stream: RequestStream, pipe: TextPipeline,
                      created: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": stream.request_id})
        await resp.prepare(request)
        model = self.cfg.model_name
        chunker = ChatChunker(request_id=stream.request_id, model=model, created=created,
                              thinking=req.thinking) if req.chat else None
        cached = 0
        finish = None

        def text_chunk(text: str, finish_reason: str | None) -> dict[str, Any]:
            return {"id": stream.request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

        try:
            delivered = 0  # tokens in the chunks so far (the engine may be ahead: num_generated)
            async for out in stream:
                cached = out.num_cached_tokens
                delivered += len(out.new_token_ids)
                text = pipe.feed(out.new_token_ids, finished=out.finished, finish_reason=out.finish_reason)
                finish = out.finish_reason
                if chunker is not None:
                    chunks = chunker.feed(text, final=out.finished or pipe.stopped)
                else:
                    chunks = [text_chunk(text, None)] if text else []
                if chunks:
                    if req.continuous_usage:
                        usage = usage_of(len(req.prompt_ids), delivered, cached)
                        chunks = [{**c, "usage": usage} for c in chunks]
                    await resp.write(b"".join(_sse(c) for c in chunks))
                if pipe.stopped:
                    stream.abort("stop")
                    break
            self.metrics.cached_prompt_tokens.inc(cached)
            tool_calls = chunker is not None and chunker.num_tool_calls > 0
            reason = finish_reason_of(finish, pipe.stopped, tool_calls)
            tail = [chunker.final(reason) if chunker is not None else text_chunk("", reason)]
            usage = usage_of(len(req.prompt_ids), stream.num_generated, cached)
            if req.continuous_usage:
                tail[0]["usage"] = usage
            if req.include_usage:
                tail.append(chunker.usage(usage) if chunker is not None else
                            {**text_chunk("", None), "choices": [], "usage": usage})
            await resp.write(b"".join(_sse(c) for c in tail) + b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            log.info("client of %s disconnected mid-stream; request aborted", stream.request_id)
        except Exception as e:  # the headers are out: the error can only go in the stream
            if isinstance(e, EngineStepError):
                err = ApiError(500, str(e), code="engine_step_failed")
            else:
                log.exception("streaming %s failed", stream.request_id)
                err = ApiError(500, "internal server error; see the server log", code="internal_error")
            with contextlib.suppress(ConnectionError):
                await resp.write(_sse(err.body()) + b"data: [DONE]\n\n")
        return resp


def create_app(async_engine: AsyncEngine, *, model_name: str, metrics: ServingMetrics | None = None
               ) -> web.Application:
    """The aiohttp Application; it starts the engine thread on startup and stops it on cleanup."""
    return OpenAIServer(async_engine, model_name=model_name, metrics=metrics).app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Starts listening; returns the runner (`await runner.cleanup()` stops it). Handlers are cancelled when
    their client disconnects, which aborts the request in the engine."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return runner


class BackgroundServer:
    """The server on its own event loop in a background thread (tests, the bench smoke run, notebooks).

        with BackgroundServer(engine, model_name="tiny") as srv:
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    """

    def __init__(self, engine: Any, *, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 metrics: ServingMetrics | None = None) -> None:
        self.metrics = metrics or ServingMetrics()
        self.async_engine = AsyncEngine(engine, metrics=self.metrics)
        self.model_name = model_name
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "BackgroundServer":
        self._thread = threading.Thread(target=self._main, name="dsv41-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the server did not start listening within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"the server failed to start: {self._error!r}") from self._error
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            app = create_app(self.async_engine, model_name=self.model_name, metrics=self.metrics)
            self._runner = loop.run_until_complete(serve(app, self.host, self.port))
            if self.port == 0:
                self.port = self._runner.addresses[0][1]
        except BaseException as e:
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        """Runs a coroutine on the server's loop and waits for it (e.g. `srv.run(srv.async_engine.stats())`)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(60)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
