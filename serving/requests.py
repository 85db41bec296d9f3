"""Validated requests (`serving.protocol` models) -> what the engine runs: prompt ids, sampling, stop strings.

The checks that need the model or the server (context length, vocabulary, what is unsupported) live here; the
types and ranges are the pydantic models'. Every refusal is a 400 that names the field and the way out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from dsv41 import chat as chat_format
from serving import media as media_lib
from serving.async_engine import SamplingParams
from serving.errors import ApiError, bad_request
from serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
# OpenAI reasoning_effort names that the V4.1 presets lack, mapped onto the nearest preset.
_EFFORT_ALIASES = {"minimal": "low", "medium": "high", "xhigh": "max"}


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
    skip_special_tokens: bool = True
    images: tuple = ()  # serving.engine.images.PromptImage per image span of prompt_ids


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_id: int
    bos_id: int
    model_cfg: Any = None  # the engine's ModelConfig (its vision_config and image token), None if unknown
    media: media_lib.MediaConfig = media_lib.MediaConfig()


def validation_error(errors: Sequence[dict[str, Any]]) -> ApiError:
    """A pydantic validation failure as a 400 naming the first bad field (`param` is its top-level name)."""
    if not errors:
        return bad_request("the request body is not valid", code="invalid_request")
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON ({e.get('ctx', {}).get('error', 'decode error')}); "
                           "send a JSON object", code="invalid_json")
    if not loc:
        return bad_request(f"the request body must be a JSON object with the request's fields ({e.get('msg')})",
                           code="invalid_json")
    # union members show up in loc as their type names; the field path is what a client can act on
    path = ".".join(str(p) for p in loc if isinstance(p, int) or not any(c in p for c in "[]-,"))
    got = repr(e.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    code = "missing_required_parameter" if e.get("type") == "missing" else (
        "invalid_type" if "type" in str(e.get("type")) else "invalid_value")
    msg = f"{path}: {e.get('msg')}" + ("" if e.get("type") == "missing" else f", got {got}") + more
    return bad_request(msg, str(loc[0]), code)


def check_model(model: str | None, cfg: ServerConfig) -> None:
    if model is not None and model != cfg.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {cfg.model_name!r} "
                            "(see GET /v1/models)", param="model", code="model_not_found")


def _unsupported(name: str, value: Any, ok: bool, what: str) -> None:
    if value is not None and not ok:
        raise bad_request(f"{name}={value!r} is not supported by this server; {what}"[:400], name, "unsupported")


def _check_text(text: str, param: str) -> None:
    """Lone UTF-16 surrogates (JSON "\\ud800") cannot be tokenized or written back as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{param} holds a lone UTF-16 surrogate at character {e.start} ({text[e.start]!r}); "
                          "send valid Unicode (pair surrogates, or drop them)", param, "invalid_unicode") from None


def _common(r: SamplingFields, cfg: ServerConfig, prompt_ids: list[int], *, chat: bool, max_tokens: int | None,
            session_header: str | None) -> dict[str, Any]:
    n_prompt = len(prompt_ids)
    prompt_param = "messages" if chat else "prompt"
    if n_prompt == 0:
        raise bad_request("the prompt is empty; send at least one token", prompt_param)
    if n_prompt >= cfg.max_model_len:
        raise bad_request(f"this model's maximum context length is {cfg.max_model_len} tokens, but the prompt has "
                          f"{n_prompt} tokens; shorten the prompt", prompt_param, "context_length_exceeded")
    if r.n not in (None, 1):
        raise bad_request(f"n={r.n}: this server returns one choice per request (n=1); send separate requests",
                          "n", "unsupported")
    room = cfg.max_model_len - n_prompt
    if max_tokens is None:
        max_tokens = room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    if max_tokens > room:
        raise bad_request(f"this model's maximum context length is {cfg.max_model_len} tokens; the request has "
                          f"{n_prompt} prompt tokens and asks for {max_tokens} completion tokens "
                          f"({n_prompt + max_tokens} in all); lower max_tokens to at most {room} or shorten the "
                          "prompt", "max_tokens", "context_length_exceeded")
    _unsupported("presence_penalty", r.presence_penalty, r.presence_penalty == 0, "leave it at 0")
    _unsupported("frequency_penalty", r.frequency_penalty, r.frequency_penalty == 0, "leave it at 0")
    _unsupported("repetition_penalty", r.repetition_penalty, r.repetition_penalty == 1, "leave it at 1")
    _unsupported("logit_bias", r.logit_bias, r.logit_bias == {}, "leave it out")
    if isinstance(r.stop, str):
        stop: tuple[str, ...] = (r.stop,) if r.stop else ()
    else:
        stop = tuple(s for s in r.stop or () if s)
    for s in stop:
        _check_text(s, "stop")
    bad_ids = [i for i in r.stop_token_ids or () if i >= cfg.vocab_size]
    if bad_ids:
        raise bad_request(f"stop_token_ids must be token ids in [0, {cfg.vocab_size}); got {bad_ids[:5]}",
                          "stop_token_ids")
    opts = r.stream_options
    if opts is not None and not r.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if r.user is not None:
        _check_text(r.user, "user")
    # top_k at or past the vocabulary keeps every token: the same as off, and small enough for any int32 array
    top_k = r.top_k or 0
    top_k = 0 if top_k == -1 or top_k >= cfg.vocab_size else top_k
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0 if r.temperature is None else r.temperature,
                              top_p=1.0 if r.top_p is None else r.top_p, top_k=top_k, seed=r.seed,
                              stop_token_ids=tuple(r.stop_token_ids or ()), ignore_eos=bool(r.ignore_eos))
    return dict(sampling=sampling, stop=stop, stream=bool(r.stream),
                include_usage=bool(opts and opts.include_usage),
                continuous_usage=bool(opts and opts.continuous_usage_stats),
                session=session_header or r.user or None,
                skip_special_tokens=r.skip_special_tokens is not False)


def completion_request(r: CompletionRequest, cfg: ServerConfig, tokenizer: Any,
                       session_header: str | None = None) -> GenRequest:
    check_model(r.model, cfg)
    _unsupported("echo", r.echo, r.echo is False, "leave it false")
    _unsupported("best_of", r.best_of, r.best_of == 1, "leave it at 1")
    _unsupported("suffix", r.suffix, False, "leave it out")
    _unsupported("logprobs", r.logprobs, False, "leave it out (logprobs are not returned)")
    prompt = r.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check_text(prompt, "prompt")
        ids = tokenizer.encode(prompt)
        if not ids or ids[0] != cfg.bos_id:
            ids = [cfg.bos_id, *ids]
    elif prompt and all(isinstance(i, int) for i in prompt):
        bad = [i for i in prompt if i >= cfg.vocab_size]
        if bad:
            raise bad_request(f"prompt token ids must be in [0, {cfg.vocab_size}); got {bad[:5]}", "prompt")
        ids = list(prompt)
    elif len(prompt) > 1:
        raise bad_request(f"prompt is a batch of {len(prompt)} prompts; send one prompt per request", "prompt",
                          "unsupported")
    else:
        raise bad_request("prompt is empty; send a string or a non-empty array of token ids", "prompt")
    return GenRequest(ids, **_common(r, cfg, ids, chat=False, max_tokens=r.max_tokens,
                                     session_header=session_header))


def _thinking_options(r: ChatCompletionRequest) -> tuple[bool, int | str | None]:
    ctk = r.chat_template_kwargs
    thinking = None if ctk is None else (ctk.thinking if ctk.thinking is not None else ctk.enable_thinking)
    effort = r.reasoning_effort if r.reasoning_effort is not None else (ctk.reasoning_effort if ctk else None)
    if effort == "none":
        return False if thinking is None else thinking, None
    if isinstance(effort, str):
        effort = _EFFORT_ALIASES.get(effort, effort)
    if thinking is None:
        thinking = effort is not None
    return thinking, effort


def _messages(r: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in r.messages]


def chat_request(r: ChatCompletionRequest, cfg: ServerConfig, tokenizer: Any,
                 session_header: str | None = None) -> GenRequest:
    check_model(r.model, cfg)
    _unsupported("logprobs", r.logprobs, r.logprobs is False, "leave it out (logprobs are not returned)")
    _unsupported("top_logprobs", r.top_logprobs, r.top_logprobs == 0, "leave it out")
    _unsupported("response_format", r.response_format and r.response_format.type,
                 r.response_format is None or r.response_format.type == "text",
                 "only {\"type\": \"text\"} is supported (no guided decoding)")
    if r.tool_choice is not None and not r.tools:
        raise bad_request("tool_choice is only allowed when tools are given; send tools or leave tool_choice out",
                          "tool_choice")
    if r.tool_choice not in (None, "auto", "none"):
        raise bad_request(f"tool_choice={r.tool_choice!r}"[:200] + ": only \"auto\" and \"none\" are supported "
                          "(no forced tool calls)", "tool_choice", "unsupported")
    thinking, effort = _thinking_options(r)
    messages = _messages(r)
    tools = [t.model_dump(exclude_none=True) for t in r.tools] if r.tools and r.tool_choice != "none" else None
    try:
        segments = chat_format.encode_chat_segments(messages, thinking=thinking, reasoning_effort=effort,
                                                    tools=tools)
    except chat_format.ChatFormatError as e:
        param = "reasoning_effort" if "reasoning_effort" in str(e) else "messages"
        raise bad_request(str(e), param) from None
    for text, _ in segments:
        _check_text(text, "messages")
    ids = tokenizer.encode_segments(segments)
    ids, images = media_lib.place(ids, media_lib.prompt_images(messages, cfg.media, cfg.model_cfg), cfg.model_cfg)
    max_tokens = r.max_tokens if r.max_tokens is not None else r.max_completion_tokens
    return GenRequest(ids, **_common(r, cfg, ids, chat=True, max_tokens=max_tokens, session_header=session_header),
                      chat=True, thinking=thinking, images=images)
