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

`tool_choice` "required" and a named function force a call, by constrained decoding as vLLM does
it (`plan_tools`): the reply is JSON that the engine's grammar holds to, not the model's own call
syntax, and compact (no whitespace between tokens; see `_compact`). Named: the function's
arguments (its `parameters` schema), answered as one call of it, `finish_reason` "stop".
Required: a list of `{"name", "parameters"}` objects, one of the tools each (at most one when
`parallel_tool_calls` is false), answered as those calls, `finish_reason` "tool_calls". A function
without `parameters` takes none (an empty object). Arguments are constrained as vLLM's xgrammar
constrains them: only the properties a schema lists, each once (`tool_schema.strict_arguments`).
A forced reply is parsed once it ended (`ForcedCallStream`): its calls are sent whole, as above;
one that does not parse (cut short by `max_tokens`) is still the named function's call with the
text as its arguments, as vLLM's; "required" among several tools then fails with the cause. With
`parallel_tool_calls` false, a free reply's calls past its first are dropped (OpenAI's
promise: at most one call). Free of FastAPI imports: the CLI reads `TOOL_PARSERS`.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from inference import StructuredOutputs
from rollout.http.core.tool_schema import strict_arguments

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
    """Base: a reply's text in, `ToolDelta`s out; `calls` holds every call parsed so far.
    `max_calls`: calls past this many are dropped (`parallel_tool_calls` false: at most one)."""

    max_calls: Optional[int] = None

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.finished = False

    def feed(self, text: str) -> ToolDelta:
        raise NotImplementedError

    def finish(self) -> ToolDelta:
        raise NotImplementedError

    def _call(self, call: ToolCall, out: ToolDelta) -> None:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return
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


class ForcedCallError(ValueError):
    """A "required" reply among several tools that does not parse (cut by `max_tokens`, say): no
    call can be named, so the request fails with the cause (vLLM answers 400 with its parse error)."""


class ForcedCallStream(ToolStream):
    """A forced reply (see module docstring): held whole, parsed at the end. `name`: the function
    a named choice forces; None for "required" (a JSON list of calls), whose lone tool is `only`.

    A reply that does not parse is still a call, never `content`, as vLLM answers it: the named
    function's (or a lone tool's) with the text as its `arguments`; among several tools,
    `ForcedCallError`."""

    def __init__(self, name: Optional[str], only: Optional[str] = None) -> None:
        super().__init__()
        self.name, self.only = name, only
        self.buffer = ""

    def feed(self, text: str) -> ToolDelta:
        self.buffer += text
        return ToolDelta()

    def finish(self) -> ToolDelta:
        out, text, self.buffer, self.finished = ToolDelta(), self.buffer, "", True
        for call in self._parse(text):
            self._call(call, out)
        return out

    def _parse(self, text: str) -> list[ToolCall]:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            obj, cause = None, f"it is not JSON ({exc})"
        else:
            cause = "it is not a JSON object" if self.name is not None else "it is not a non-empty list of calls"
        if self.name is not None:
            return [ToolCall(self.name, json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else text)]
        calls = [parse_call(json.dumps(item)) for item in obj] if isinstance(obj, list) and obj else [None]
        if all(c is not None for c in calls):
            return calls
        if self.only is not None:
            return [ToolCall(self.only, text)]
        raise ForcedCallError(f'The reply forced by tool_choice "required" names no call: {cause}; '
                              f"raise max_tokens if it was cut short. Reply: {text[:200]!r}")


@dataclass(slots=True)
class ToolPlan:
    """How a chat reply is read for calls: `parser` for a free reply (NONE: not parsed), or a forced
    call: `forced`, the constraint the reply is decoded under, and `named`, the function a named
    choice forces (None for "required")."""

    parser: ToolParser = ToolParser.NONE
    forced: Optional[StructuredOutputs] = None
    named: Optional[str] = None
    max_calls: Optional[int] = None  # 1 when `parallel_tool_calls` is false
    only: Optional[str] = None  # "required" among one tool: its name

    def stream(self) -> Optional[ToolStream]:
        """A fresh stream for one reply, None when replies are not parsed."""
        stream = ForcedCallStream(self.named, self.only) if self.forced is not None else tool_stream(self.parser)
        if stream is not None:
            stream.max_calls = self.max_calls
        return stream

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """A whole reply as (content, calls): content None when free calls left no text, "" for a
        forced call (vLLM's answer)."""
        stream = self.stream()
        if stream is None:
            return text, []
        out = stream.feed(text)
        out += stream.finish()
        if stream.calls and not out.content:
            return ("" if self.forced is not None else None), stream.calls
        return out.content, stream.calls

    def finish_reason(self, calls: bool, reason: Optional[str]) -> Optional[str]:
        """A choice's `finish_reason`: "tool_calls" when calls were made, except for a named choice."""
        return "tool_calls" if calls and self.named is None else reason


def plan_tools(tool_choice: Any, tools: Optional[list[dict]], parser: ToolParser,
               parallel_tool_calls: Optional[bool] = None) -> ToolPlan:
    """The `ToolPlan` of a chat body; `ToolChoiceError` for a `tool_choice` refused."""
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan(parser if tools else ToolParser.NONE, max_calls=1 if parallel_tool_calls is False else None)
    if tool_choice == "none":
        return ToolPlan()
    if tool_choice == "required" and tools == []:
        return ToolPlan()  # OpenAI's answer: no tool to call, so no call required
    if not tools:
        raise ToolChoiceError("When using `tool_choice`, `tools` must be set.")
    functions = _functions(tools)
    if tool_choice == "required":
        only = next(iter(functions)) if len(functions) == 1 else None
        return ToolPlan(forced=_compact(_calls_schema(functions, parallel_tool_calls)), only=only)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise ToolChoiceError("Invalid `tool_choice`: a named tool choice is "
                              '`{"type": "function", "function": {"name": "my_function"}}`.')
    if name not in functions:
        raise ToolChoiceError("The tool specified in `tool_choice` does not match any of the specified `tools`.")
    return ToolPlan(forced=_compact(functions[name]), named=name)


def _compact(schema: dict) -> StructuredOutputs:
    # NOTE: JSON without whitespace between its tokens: with whitespace free, a model that wants to
    # write its own call syntax where the grammar forbids it (a `}}` or `</tool_call>`) can spend its
    # whole budget on newlines, the one thing still allowed
    return StructuredOutputs(json=json.dumps(schema), disable_any_whitespace=True)


_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no parameters


def _functions(tools: list[dict]) -> dict[str, dict]:
    """{name: its parameters' JSON schema, strict (`strict_arguments`)} of OpenAI's `tools`."""
    out = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolChoiceError('Each of `tools` is `{"type": "function", "function": {"name": ..., '
                                  '"parameters": {...}}}`.')
        parameters = function.get("parameters") or _NO_ARGUMENTS
        if not isinstance(parameters, dict):
            raise ToolChoiceError(f"The parameters of tool `{function['name']}` must be a JSON schema object.")
        out[function["name"]] = strict_arguments(parameters)  # NOTE: as vLLM's xgrammar reads it (tool_schema)
    return out


def _calls_schema(functions: dict[str, dict], parallel: Optional[bool]) -> dict:
    """The JSON schema of a "required" reply: a non-empty list of calls, each one of the tools.
    The tools' `$defs` move to the top, where their `#/$defs/...` references point."""
    defs: dict[str, Any] = {}
    options = []
    for name, parameters in functions.items():
        parameters = dict(parameters)
        for key, schema in (parameters.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != schema:
                raise ToolChoiceError(f"Tools define `$defs/{key}` differently; rename one of them.")
            defs[key] = schema
        options.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                        "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
