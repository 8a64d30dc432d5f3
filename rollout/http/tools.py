"""Tool calls in a chat reply: parsing a model's text into OpenAI's `message.tool_calls`.

A server is started with one parser for its model (`--tool-call-parser`, as vLLM's flag):

* `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes 2 Pro,
  Qwen2.5, Qwen3); an unclosed block at the end of the reply counts, as in vLLM;
* `llama3_json`: a reply that is Llama 3.x JSON calls, `{"name": ..., "parameters": {...}}`
  (`arguments` also taken), optionally after `<|python_tag|>`, several joined by `;`;
* `none` (the default): no parsing; tools still reach the chat template.

One streaming state machine (`ToolStream`) does the work for both paths: a complete reply is
`feed(text)` then `finish()`, so a non-streamed reply and the concatenated deltas of a streamed
one are the same by construction. Its invariants:

* text is never shown that could still turn out to be part of a call: the tail that could be the
  start of `<tool_call>` is held back until the next text (or the end) rules it out;
* a call is sent whole, in one delta, once its block is closed (or the reply ended) and its JSON
  parsed: a block that does not parse (malformed JSON, no `name`) stays in `content` verbatim, as
  vLLM leaves it, and nothing already sent ever has to be taken back;
* `content` is the text outside the calls, as written except for the whitespace right after a
  call (Qwen2.5 puts a newline between blocks).

`tool_choice` "required" and a named function need the reply constrained to a call (a grammar):
`check_tool_choice` refuses them (`ToolChoiceError`, the route's 400 naming `tool_choice`) until the
engine has constrained decoding. Free of FastAPI imports: the CLI reads `TOOL_PARSERS`.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolParser(enum.Enum):
    NONE = "none"
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


TOOL_PARSERS = tuple(p.value for p in ToolParser)


@dataclass(slots=True)
class ToolCall:
    """One parsed call, in OpenAI's shape by `as_dict()`; `arguments` is a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def as_delta(self, index: int) -> dict[str, Any]:
        return {"index": index, **self.as_dict()}


@dataclass(slots=True)
class ToolDelta:
    """What a reply adds to its stream: `content` text and calls (with their index in the reply)."""

    content: str = ""
    calls: list[tuple[int, ToolCall]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def __iadd__(self, other: ToolDelta) -> ToolDelta:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


class ToolChoiceError(ValueError):
    """A `tool_choice` this server refuses (the message says why)."""


def parse_call(text: str) -> Optional[ToolCall]:
    """A call from its JSON (`name`, then `arguments` or `parameters`), else None (never raises)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    # NOTE: a model that writes the arguments as a JSON string already gives OpenAI's shape
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolStream:
    """Base: a reply's text in, `ToolDelta`s out; `calls` holds every call parsed so far."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.finished = False

    def feed(self, text: str) -> ToolDelta:
        raise NotImplementedError

    def finish(self) -> ToolDelta:
        raise NotImplementedError

    def _call(self, call: ToolCall, out: ToolDelta) -> None:
        out.calls.append((len(self.calls), call))
        self.calls.append(call)


def _held_prefix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could start `tag` (0 when none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesStream(ToolStream):
    """`<tool_call>` blocks (see module docstring). State: outside a block, `pending` is text not
    yet shown (a possible tag start, or whitespace after a call); inside, the block so far."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""
        self.inside = False
        self.after_call = False  # the text outside now follows a parsed call

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        self.pending += text
        while True:
            if self.inside:
                end = self.pending.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return out
                self._close(self.pending[:end], TOOL_CALL_CLOSE, out)
                self.pending = self.pending[end + len(TOOL_CALL_CLOSE):]
                continue
            start = self.pending.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _held_prefix(self.pending, TOOL_CALL_OPEN)
                out.content += self._show(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return out
            out.content += self._show(self.pending[:start])
            self.pending = self.pending[start + len(TOOL_CALL_OPEN):]
            self.inside = True

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.inside:  # an unclosed block at the end: a call if it parses, as vLLM takes it
            self._close(self.pending, "", out)
        else:
            out.content += self._show(self.pending)
        self.pending, self.finished = "", True
        return out

    def _close(self, block: str, closing: str, out: ToolDelta) -> None:
        self.inside = False
        call = parse_call(block.strip())
        if call is None:
            out.content += TOOL_CALL_OPEN + block + closing
            self.after_call = False
        else:
            self._call(call, out)
            self.after_call = True

    def _show(self, text: str) -> str:
        """Text outside blocks as shown: whitespace right after a call is dropped."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text


class Llama3JsonStream(ToolStream):
    """A reply that starts (after whitespace) with `{` or `<|python_tag|>` is held whole and parsed
    at the end as calls joined by `;`; any other reply is content, streamed as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.mode: Optional[bool] = None  # None: undecided; True: calls; False: content

    def feed(self, text: str) -> ToolDelta:
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and len(head) < len(PYTHON_TAG)):
                return ToolDelta()
            self.mode = head.startswith("{") or head.startswith(PYTHON_TAG)
        if self.mode:
            return ToolDelta()
        out, self.buffer = ToolDelta(self.buffer), ""
        return out

    def finish(self) -> ToolDelta:
        out, text, self.buffer, self.finished = ToolDelta(), self.buffer, "", True
        if not self.mode:
            out.content = text
            return out
        body = text.strip()
        body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
        calls = [parse_call(part.strip()) for part in _split_objects(body)]
        if not calls or any(c is None for c in calls):
            out.content = text  # not calls after all: the reply as written
            return out
        for call in calls:
            self._call(call, out)
        return out


def _split_objects(body: str) -> list[str]:
    """`body` cut at the `;` between top-level JSON objects (a `;` inside a string is kept)."""
    parts, depth, in_str, escaped, start = [], 0, False, False, 0
    for i, ch in enumerate(body):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p for p in parts if p.strip()] or [body]


def tool_stream(parser: ToolParser) -> Optional[ToolStream]:
    """A fresh stream for one reply, or None when `parser` is NONE."""
    if parser is ToolParser.HERMES:
        return HermesStream()
    if parser is ToolParser.LLAMA3_JSON:
        return Llama3JsonStream()
    return None


def parse_reply(parser: ToolParser, text: str) -> tuple[Optional[str], list[ToolCall]]:
    """A whole reply as (content, calls): content None when calls were parsed and no text is left."""
    stream = tool_stream(parser)
    if stream is None:
        return text, []
    out = stream.feed(text)
    out += stream.finish()
    content = out.content
    if stream.calls and not content:
        return None, stream.calls
    return content, stream.calls


def check_tool_choice(tool_choice: Any, tools: Optional[list[dict]]) -> bool:
    """Whether to parse the reply for calls; `ToolChoiceError` for a `tool_choice` refused.

    NOTE: "required" and a named function are where a grammar-constrained path slots in: build
    the grammar of the calls here (from `tools`) and pass it with the sampling parameters; the
    parsing after it is the same as for "auto".
    """
    if tool_choice is None:
        return bool(tools)
    if tool_choice == "none":
        return False
    if tool_choice == "auto":
        return bool(tools)
    if tool_choice == "required" and tools == []:
        return False  # OpenAI's answer: no tool to call, so no call required
    if not tools:
        raise ToolChoiceError("When using `tool_choice`, `tools` must be set.")
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
            raise ToolChoiceError("Invalid `tool_choice`: a named tool choice is "
                                '`{"type": "function", "function": {"name": "my_function"}}`.')
        if name not in {(t.get("function") or {}).get("name") for t in tools if isinstance(t, dict)}:
            raise ToolChoiceError("The tool specified in `tool_choice` does not match any of the specified `tools`.")
        what = f"a named tool choice (`{name}`)"
    else:
        what = f'`tool_choice` "{tool_choice}"'
    raise ToolChoiceError(f"{what} is not supported: forcing a tool call needs constrained decoding (a grammar "
                        'of the calls), which this server does not have yet; use `tool_choice` "auto" or "none".')
