"""DeepSeek-V4.1 chat encoding (the release's `encoding/encoding.py` format) and completion parsing.

Prompt layout (spec §5):

    <｜begin▁of▁sentence｜>[<｜System｜>[Reasoning Effort: N (...)\\n\\n]system text[\\n\\n## Tools ...]]
    <｜User｜>user text<｜Assistant｜></think>answer<｜end▁of▁sentence｜>       (chat mode)
    <｜User｜>user text<｜Assistant｜><think>reasoning</think>answer<｜end▁of▁sentence｜>   (thinking mode)

- Thinking mode always carries the reasoning-effort line as the first system text (default "high" = 75).
- Tool results are not a role of their own: consecutive tool/user messages form one user turn whose parts are
  joined by a blank line, each result wrapped in `<tool_result>...</tool_result>`, ordered like the calls.
- Tool calls follow the answer text after a blank line, as a DSML block (note the space after `｜DSML｜`):
      <｜DSML｜ calls>
      <｜DSML｜ invoke name="NAME">
      <｜DSML｜ parameter name="ARG" string="true">raw text</｜DSML｜ parameter>
      <｜DSML｜ parameter name="N" string="false">JSON value</｜DSML｜ parameter>
      </｜DSML｜ invoke>
      </｜DSML｜ calls>
- In thinking mode the reasoning of assistant turns before the last user turn is dropped (those turns are then
  rendered like chat-mode turns), unless tools are defined or `drop_thinking=False`.
- A system message after the first one is a turn of its own (`<｜System｜>text`) and, like a user turn, is followed
  by the assistant header.

`parse_completion` / `ChatStreamParser` turn generated text back into reasoning, content and OpenAI-style tool
calls; the streaming parser holds back text that may be the start of a tag, so no tag fragment ever leaks.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import re
import uuid
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
IMAGE = "<｜deepseek_image｜>"

CALLS_START = f"<{DSML} calls>"
CALLS_END = f"</{DSML} calls>"
_INVOKE = f'<{DSML} invoke name="{{name}}">\n{{params}}\n</{DSML} invoke>'
_PARAM = f'<{DSML} parameter name="{{name}}" string="{{is_str}}">{{value}}</{DSML} parameter>'
_TOOL_RESULT = "<tool_result>{}</tool_result>"

# The release's presets (HF revision dba1be0a: low=50, high=75, max=100, default high). vLLM's vendored copy
# uses another table (low=25, high=50, xhigh=75, max=100); the release is what the model was tuned with.
REASONING_EFFORT_PRESETS = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"
_EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

# The system-prompt block that introduces tools, as the release writes it (the model was trained on this text).
_TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{CALLS_START}" block like the following:

{CALLS_START}
<{DSML} invoke name="$TOOL_NAME">
<{DSML} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML} parameter>
...
</{DSML} invoke>
<{DSML} invoke name="$TOOL_NAME2">
...
</{DSML} invoke>
{CALLS_END}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside \
{THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_ROLES = ("system", "developer", "user", "assistant", "tool")
_IMAGE_ROLES = ("user", "developer")
_IMAGE_PARTS = ("image_url", "image", "input_image")


class ChatFormatError(ValueError):
    """A message list, tool call or option that the V4.1 format cannot encode."""


# ---- encoding ------------------------------------------------------------------------------------


def encode_chat(
    messages: list[dict[str, Any]],
    *,
    thinking: bool = False,
    reasoning_effort: int | str | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
) -> str:
    """Renders OpenAI-style messages as a V4.1 prompt (BOS included, as text).

    messages: dicts with `role` in system/developer/user/assistant/tool; `content` a string, None, or a list of
      {"type": "text"} / {"type": "image_url"} parts (images become `<｜deepseek_image｜>` placeholders, one image
      token each, in message order; `image_parts` lists the parts);
      assistants may carry `reasoning_content` and `tool_calls`; tool messages may carry `tool_call_id`.
    reasoning_effort: 1..100 or one of REASONING_EFFORT_PRESETS (thinking mode only; validated always).
    tools: OpenAI tool definitions; rendered into the first system message (one is created if absent).
    add_generation_prompt: append `<｜Assistant｜>` + `<think>`/`</think>` after a final user/system turn.
    drop_thinking: drop the reasoning of turns before the last user turn (the release's default).

    The text is what the release's encoder writes; to tokenize it so that tags typed inside messages stay text,
    use `encode_chat_segments` with `Tokenizer.encode_segments`.
    """
    return "".join(text for text, _ in encode_chat_segments(
        messages, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools,
        add_generation_prompt=add_generation_prompt, drop_thinking=drop_thinking))


Segment = tuple[str, bool]  # (text, True when it came from a message or tool definition rather than the template)


def encode_chat_segments(
    messages: list[dict[str, Any]],
    *,
    thinking: bool = False,
    reasoning_effort: int | str | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
) -> list[Segment]:
    """encode_chat's prompt as pieces that say which text the client wrote: a client's `<｜User｜>` or DSML tag
    must reach the model as those characters, never as the token that starts a turn or a tool call."""
    effort = _effort_value(reasoning_effort)
    msgs = [_normalize_message(i, m) for i, m in enumerate(messages)]
    if tools:
        functions = [_tool_function(t) for t in tools]
        if not msgs or msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = functions
    msgs = _merge_tool_results(msgs)
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_old_reasoning(msgs)
    last_user = _last_user_index(msgs)

    out: list[Segment] = [(BOS, False)]
    for i, m in enumerate(msgs):
        role = m["role"]
        if i == 0 and thinking:
            out.append((SYSTEM + _EFFORT_LINE.format(effort), False))
        elif i == 0 and role == "system":
            out.append((SYSTEM, False))
        if role == "system":
            if i > 0:
                out.append((SYSTEM, False))
            out += [(m["content"], True), *_tools_suffix(m)]
        elif role == "developer":
            out += [(USER, False), *_content_segments(m["content"]), *_tools_suffix(m)]
        elif role == "user":
            out += [(USER, False), *_content_segments(m["content"])]
        else:  # assistant
            if thinking and (not drop or i > last_user):
                out += [(m.get("reasoning_content", ""), True), (THINK_END, False)]
            out += [(m["content"], True), *_render_tool_calls(m.get("tool_calls")), (EOS, False)]

        is_last = i == len(msgs) - 1
        if is_last and not add_generation_prompt:
            break
        if not is_last and msgs[i + 1]["role"] != "assistant":
            continue
        if role in ("user", "developer") or (role == "system" and i > 0):
            opens_thinking = thinking and (not drop or i >= last_user)
            out.append((ASSISTANT + (THINK_START if opens_thinking else THINK_END), False))
    return [seg for seg in out if seg[0]]


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image content parts of `messages`, in the order of their image tokens in the encoded prompt."""
    return [part for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS]


def _content_segments(content: str) -> list[Segment]:
    """A message's text with its image placeholders as template text (the image token, which the engine expands
    into the image's span); `_text_of` refuses the placeholder in client text, so every one is an image part."""
    out: list[Segment] = []
    for k, piece in enumerate(content.split(IMAGE)):
        if k:
            out.append((IMAGE, False))
        out.append((piece, True))
    return out


def _effort_value(effort: int | str | None) -> int:
    if effort is None:
        effort = DEFAULT_REASONING_EFFORT
    if isinstance(effort, str):
        if effort not in REASONING_EFFORT_PRESETS:
            raise ChatFormatError(f"reasoning_effort {effort!r}: use an integer in [1, 100] or one of "
                                  f"{sorted(REASONING_EFFORT_PRESETS)}")
        return REASONING_EFFORT_PRESETS[effort]
    if isinstance(effort, bool) or not isinstance(effort, int) or not 1 <= effort <= 100:
        raise ChatFormatError(f"reasoning_effort {effort!r}: use an integer in [1, 100] or one of "
                              f"{sorted(REASONING_EFFORT_PRESETS)}")
    return effort


def _text_of(content: Any, where: str) -> str:
    """Message content as text: parts are joined by a blank line, images become placeholders."""
    if content is None:
        return ""
    if isinstance(content, str):
        if IMAGE in content:
            raise ChatFormatError(f"{where}: content contains the image token {IMAGE!r}; "
                                  "send images as image_url content parts")
        return content
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}: content must be a string, a list of parts or None, "
                              f"got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append(_text_of(part.get("text") or "", f"{where} part {j}"))
        elif kind in _IMAGE_PARTS:
            parts.append(IMAGE)
        else:
            raise ChatFormatError(f"{where} part {j}: unsupported content part type {kind!r} (text and images only)")
    return "\n\n".join(parts)


def _normalize_message(i: int, msg: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise ChatFormatError(f"message {i}: expected a dict, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in _ROLES:
        raise ChatFormatError(f"message {i}: role {role!r} is not one of {list(_ROLES)}")
    where = f"message {i} ({role})"
    out: dict[str, Any] = {"role": role, "content": _text_of(msg.get("content"), where)}
    if role not in _IMAGE_ROLES and IMAGE in out["content"]:
        raise ChatFormatError(f"{where}: images are accepted in user messages only; move the image_url part "
                              "into a user message")
    if role == "assistant":
        rc = msg.get("reasoning_content", msg.get("reasoning"))
        if rc is not None:
            if not isinstance(rc, str):
                raise ChatFormatError(f"{where}: reasoning_content must be a string")
            if IMAGE in rc:
                raise ChatFormatError(f"{where}: reasoning_content contains the image token {IMAGE!r}")
            out["reasoning_content"] = rc
        if msg.get("tool_calls"):
            out["tool_calls"] = [_tool_call_of(where, k, tc) for k, tc in enumerate(msg["tool_calls"])]
    elif role == "tool":
        out["tool_call_id"] = msg.get("tool_call_id") or ""
    elif role == "developer" and not out["content"]:
        raise ChatFormatError(f"{where}: developer messages need content")
    return out


def _tool_call_of(where: str, k: int, tc: dict[str, Any]) -> dict[str, Any]:
    """{id, name, arguments: dict} from an OpenAI tool call (arguments as a JSON string or a dict)."""
    fn = tc.get("function", tc) if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatFormatError(f"{where} tool call {k}: needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{where} tool call {k} ({fn['name']}): arguments are not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where} tool call {k} ({fn['name']}): arguments must be a JSON object, "
                              f"got {type(args).__name__}")
    return {"id": tc.get("id") or "", "name": fn["name"], "arguments": args}


def _tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not fn.get("name"):
        raise ChatFormatError(f"tool definition needs function.name, got {tool!r}")
    return fn


def _tools_suffix(msg: dict[str, Any]) -> list[Segment]:
    if not msg.get("tools"):
        return []
    schemas = "\n".join(json.dumps(fn, ensure_ascii=False) for fn in msg["tools"])
    before, after = _TOOLS_PROMPT.split("{schemas}")
    return [("\n\n" + before, False), (schemas, True), (after, False)]


def _render_tool_calls(calls: list[dict[str, Any]] | None) -> list[Segment]:
    if not calls:
        return []
    out: list[Segment] = [("\n\n" + CALLS_START + "\n", False)]
    for k, c in enumerate(calls):
        head, tail = _INVOKE.split("{params}")
        before_name, after_name = head.split("{name}")
        out += [(("\n" if k else "") + before_name, False), (c["name"], True), (after_name, False)]
        for j, (name, v) in enumerate(c["arguments"].items()):
            value = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
            p_head, p_tail = _PARAM.split("{value}")
            p_before, p_after = p_head.split("{name}")
            out += [(("\n" if j else "") + p_before, False), (name, True),
                    (p_after.format(is_str="true" if isinstance(v, str) else "false"), False), (value, True),
                    (p_tail, False)]
        out.append((tail, False))
    out.append(("\n" + CALLS_END, False))
    return out


def _merge_tool_results(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Folds runs of user/tool messages into single user turns; tool results follow their calls' order."""
    out: list[dict[str, Any]] = []
    call_order: dict[str, int] = {}
    parts: list[tuple[str, str, str]] = []  # (kind, text, tool_call_id) of the open user turn

    def close() -> None:
        if not parts:
            return
        tool_slots = [j for j, p in enumerate(parts) if p[0] == "tool"]
        if len(tool_slots) > 1 and call_order:
            ordered = sorted((parts[j] for j in tool_slots), key=lambda p: call_order.get(p[2], 0))
            for j, p in zip(tool_slots, ordered):
                parts[j] = p
        out.append({"role": "user", "content": "\n\n".join(p[1] for p in parts)})
        parts.clear()

    for m in msgs:
        if m["role"] == "user":
            parts.append(("text", m["content"], ""))
        elif m["role"] == "tool":
            parts.append(("tool", _TOOL_RESULT.format(m["content"]), m["tool_call_id"]))
        else:
            close()
            if m["role"] == "assistant" and m.get("tool_calls"):
                call_order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if c["id"]}
            out.append(m)
    close()
    return out


def _last_user_index(msgs: list[dict[str, Any]]) -> int:
    """Last turn that asks for an answer: a user/developer turn or a system turn after the first message."""
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i]["role"] in ("user", "developer") or (msgs[i]["role"] == "system" and i > 0):
            return i
    return -1


def _drop_old_reasoning(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before the last user turn: assistants lose their reasoning, developer turns are left out (as the release)."""
    last = _last_user_index(msgs)
    out = []
    for i, m in enumerate(msgs):
        if i >= last or m["role"] in ("user", "system"):
            out.append(m)
        elif m["role"] == "assistant":
            m = dict(m)
            m.pop("reasoning_content", None)
            out.append(m)
    return out


# ---- parsing -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str  # a JSON object, as OpenAI's function.arguments

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclasses.dataclass(frozen=True)
class ParsedCompletion:
    reasoning_content: str | None  # None when no reasoning was produced (chat mode)
    content: str
    tool_calls: tuple[ToolCall, ...]


@dataclasses.dataclass(frozen=True)
class StreamDelta:
    """What one `feed` made final: new reasoning text, new content text, tool calls completed in this step."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class _State(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOLS = "tools"


_INVOKE_END_RE = re.compile(rf"</{DSML}\s*invoke\s*>")
_CALLS_END_RE = re.compile(rf"</{DSML}\s*calls\s*>")
_INVOKE_NAME_RE = re.compile(rf'<{DSML}\s*invoke\s+name="([^"]*)"\s*>')
_PARAM_RE = re.compile(
    rf'<{DSML}\s*parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</{DSML}\s*parameter\s*>', re.DOTALL)

# Tags watched outside a tool-call block, and what each does in each state.
_TEXT_TAGS = (THINK_START, THINK_END, CALLS_START, EOS)


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ChatStreamParser:
    """Incremental completion parser: `feed(text)` -> StreamDelta, `finish()` at the end of generation.

    Reasoning is the text up to `</think>` (thinking mode starts inside it, as the prompt ends with `<think>`);
    a tool-call block ends reasoning too. Tool calls are emitted whole, when their `</｜DSML｜ invoke>` arrives.
    Content whitespace right before a tool-call block is the format's separator and is dropped. Stateful: one
    parser per generated sequence.
    """

    def __init__(self, *, thinking: bool, new_call_id: Callable[[], str] = _new_call_id) -> None:
        self._state = _State.REASONING if thinking else _State.CONTENT
        self._buf = ""
        self._new_id = new_call_id
        self.saw_reasoning = thinking

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> StreamDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> StreamDelta:
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._state is _State.TOOLS:
                if not self._step_tools(calls, final):
                    break
                continue
            sink = reasoning if self._state is _State.REASONING else content
            hits = [(self._buf.find(t), t) for t in _TEXT_TAGS]
            hits = [(at, t) for at, t in hits if at >= 0]
            if not hits:
                keep = 0 if final else self._holdback()
                sink.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            at, tag = min(hits)
            before, self._buf = self._buf[:at], self._buf[at + len(tag):]
            if tag == CALLS_START:
                sink.append(before.rstrip() if self._state is _State.CONTENT else before)
                self._state = _State.TOOLS
            else:
                sink.append(before)
                if tag == THINK_START and self._state is _State.CONTENT:
                    self._state = _State.REASONING
                    self.saw_reasoning = True
                elif tag == THINK_END and self._state is _State.REASONING:
                    self._state = _State.CONTENT
                # else: a stray <think> / </think> / EOS text is dropped
        return StreamDelta("".join(reasoning), "".join(content), tuple(calls))

    def _holdback(self) -> int:
        """Length of the buffer tail that must wait: a possible tag start, plus (in content) the whitespace
        before it, which is dropped if a tool-call block follows."""
        buf = self._buf
        keep = 0
        for tag in _TEXT_TAGS:
            for n in range(min(len(tag) - 1, len(buf)), keep, -1):
                if buf.endswith(tag[:n]):
                    keep = n
                    break
        if self._state is _State.CONTENT:
            stem = buf[: len(buf) - keep]
            keep += len(stem) - len(stem.rstrip())
        return keep

    def _step_tools(self, calls: list[ToolCall], final: bool) -> bool:
        """Consumes one complete invoke or the block end; False when more text is needed."""
        inv = _INVOKE_END_RE.search(self._buf)
        end = _CALLS_END_RE.search(self._buf)
        if inv and (not end or inv.start() < end.start()):
            segment, self._buf = self._buf[: inv.start()], self._buf[inv.end():]
            call = self._parse_invoke(segment)
            if call is not None:
                calls.append(call)
            return True
        if end:
            leftover = self._buf[: end.start()].replace(EOS, "")
            if leftover.strip():
                log.warning("tool-call block: dropped text outside any invoke: %r", leftover[:200])
            self._buf = self._buf[end.end():]
            self._state = _State.CONTENT
            return True
        if final:
            if self._buf.replace(EOS, "").strip():
                log.warning("tool-call block not closed at the end of generation: dropped %r", self._buf[:200])
            self._buf = ""
        return False

    def _parse_invoke(self, segment: str) -> ToolCall | None:
        head = _INVOKE_NAME_RE.search(segment)
        if head is None:
            log.warning("tool-call block: invoke without a name dropped: %r", segment[:200])
            return None
        args: dict[str, Any] = {}
        for m in _PARAM_RE.finditer(segment, head.end()):
            name, is_str, value = m.group(1), m.group(2), m.group(3)
            if is_str == "true":
                args[name] = value
            else:
                try:
                    args[name] = json.loads(value)
                except json.JSONDecodeError:
                    log.warning("tool %s: parameter %s is marked string=\"false\" but is not JSON; kept as text",
                                head.group(1), name)
                    args[name] = value
        return ToolCall(id=self._new_id(), name=head.group(1), arguments_json=json.dumps(args, ensure_ascii=False))


def parse_completion(text: str, *, thinking: bool,
                     new_call_id: Callable[[], str] = _new_call_id) -> ParsedCompletion:
    """Splits a whole generated text (what follows the prompt) into reasoning, content and tool calls.

    thinking: whether the prompt was encoded in thinking mode (it then ends with `<think>`).
    Same rules as ChatStreamParser, which it runs over the whole text.
    """
    p = ChatStreamParser(thinking=thinking, new_call_id=new_call_id)
    deltas = [p.feed(text), p.finish()]
    return _join(deltas, p.saw_reasoning)


def parse_stream(chunks: Iterable[str], *, thinking: bool,
                 new_call_id: Callable[[], str] = _new_call_id) -> ParsedCompletion:
    """parse_completion over text arriving in chunks (for tests and simple clients)."""
    p = ChatStreamParser(thinking=thinking, new_call_id=new_call_id)
    deltas = [p.feed(c) for c in chunks]
    deltas.append(p.finish())
    return _join(deltas, p.saw_reasoning)


def _join(deltas: list[StreamDelta], saw_reasoning: bool) -> ParsedCompletion:
    reasoning = "".join(d.reasoning for d in deltas)
    return ParsedCompletion(
        reasoning_content=reasoning if saw_reasoning else None,
        content="".join(d.content for d in deltas),
        tool_calls=tuple(c for d in deltas for c in d.tool_calls),
    )


def tool_calls_to_openai(calls: Iterable[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI `message.tool_calls` entries."""
    return [c.to_openai() for c in calls]
