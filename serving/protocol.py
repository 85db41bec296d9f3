"""The OpenAI-compatible request and response schema as pydantic v2 models (the source of /openapi.json).

Models are strict: a string is never read as a number, nor 1 as true, as OpenAI's API answers. Fields a client
may send but this server does not use are declared (so the schema shows them) and refused with a 400 by
`serving.requests` when they ask for something the server cannot do; unknown fields are ignored, as vLLM does.
Limits follow OpenAI's: temperature in [0, 2], top_p in (0, 1], n <= 128, penalties in [-2, 2].
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 16
MAX_N = 128
INT32_MAX = 2 ** 31 - 1  # top_k travels to the engine in an int32 array


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# ---- requests -------------------------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: every chunk carries the usage so far")


class SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description="at most the context left after the prompt")
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="vLLM extension; -1 or 0: off")
    n: int | None = Field(None, ge=1, le=MAX_N, description="only 1 is served")
    seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = Field(None, description="false: special tokens appear in the text")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False, description="only 0")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False, description="only 0")
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, allow_inf_nan=False, description="only 1")
    logit_bias: dict[str, float] | None = Field(None, description="only {}")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="kept as the session key (an X-Session-Id header wins)")


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[Annotated[int, Field(ge=0, le=INT32_MAX)]], list[str],
                  list[list[Annotated[int, Field(ge=0, le=INT32_MAX)]]]]
    echo: bool | None = Field(None, description="only false")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only 1")
    suffix: str | None = Field(None, description="not supported")
    logprobs: int | None = Field(None, ge=0, le=20, description="not supported")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str = Field(description="a data: URL (base64 PNG / JPEG / WebP), or http(s) from a host the server lists "
                                 "in --allowed-media-domains")
    detail: str | None = Field(None, description="accepted and ignored: the release's sizing decides the tokens")


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl | str


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: dict[str, str]


class ChatTemplateKwargs(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    thinking: bool | None = None
    enable_thinking: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | \
        Annotated[int, Field(ge=1, le=100)] | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = Field(
        None, description="auto or none (needs tools)")
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | \
        Annotated[int, Field(ge=1, le=100)] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description='{"thinking": true} or {"enable_thinking": true}: reasoning_content apart from content')
    logprobs: bool | None = Field(None, description="only false")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="only 0")
    response_format: ResponseFormat | None = Field(None, description='only {"type": "text"}')


# ---- responses (for the schema; the handlers build plain dicts on the hot path) ---------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: dict[str, str]


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"]
    processes: list[dict] | None = None  # a multi-host engine: {"process", "alive", "last_seen_s"} for each
    # while a staged warm-up compiles the other programs in the background (steps pad to the ready ones)
    programs_ready: int | None = None
    programs: int | None = None


class HealthWarmingUp(BaseModel):
    """/health's 503 while the engine compiles its programs (with Retry-After)."""
    status: Literal["warming up"]
    programs_ready: int  # compiled and loaded
    programs: int  # to compile and load in all
    programs_compiled: int  # compiled (compiles run first, loads after)
    eta_s: float | None  # seconds left in the compile phase, estimated; None before the first program
