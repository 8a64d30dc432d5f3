"""Chat sessions without drift: the HTTP front keeps each session's token ids.

A session (an id from the `X-Session-ID` header or the `session_id` field) remembers its last
turn: the messages, the prompt ids, and each choice's reply text with the ids sampled for it.
When the next request repeats those messages, then one of those replies as an assistant message,
then new messages, its prompt is `TextCodec.continuation_ids`: the previous prompt ids + the
reply's sampled ids verbatim + the tokens of only what the chat template adds after them. The
earlier turns are never re-tokenized, so the ids a trainer sees for turn k are exactly those
sampled, and the engine's prefix cache finds the whole previous turn.

A reply parsed into tool calls continues too: the next request's assistant message names the same
calls (function names and arguments; the call ids are the client's business) and the same text
around them, and the chat template must render that message as exactly the text the model wrote
(`continuation_ids` checks it; a template that writes calls its own way starts over instead).

A turn rendered another way (`add_generation_prompt` false, `continue_final_message`) neither
continues nor changes its session: its prompt does not end where the next turn's would begin.
Anything else (a different history, an edited reply, other tools or template kwargs, an unknown or
expired id) starts
the session over from the messages, tokenized as a fresh conversation; `SessionStore.restarts`
counts those. The store is bounded (least recently used sessions are dropped first) and a session
idle for `ttl_s` is forgotten.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from rollout.text import TextCodec, message_text

Call = tuple[str, Any]  # a tool call as matched: its function's name, its arguments as parsed JSON


@dataclass(slots=True)
class Reply:
    """One choice as sampled (`text`, `ids`) and as answered: `content` (None: the text itself) and
    the tool calls parsed from it."""

    text: str
    ids: list[int]
    content: Optional[str] = None
    calls: tuple[Call, ...] = ()

    @property
    def shown(self) -> str:
        return self.text if self.content is None and not self.calls else (self.content or "")


@dataclass(slots=True)
class Render:
    """How a chat request's messages become its prompt (vLLM's chat fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Optional[dict[str, Any]] = None

    @property
    def continuable(self) -> bool:
        """Whether such a prompt ends with the generation prompt, where a session's next turn goes on."""
        return self.add_generation_prompt and not self.continue_final_message


@dataclass(slots=True)
class Session:
    messages: list[dict[str, Any]]
    tools: Optional[list[dict]]
    prompt_ids: list[int]
    replies: list[Reply]
    used: float
    template_kwargs: Optional[dict[str, Any]] = None


class SessionStore:
    """Session id -> the session's last turn (see module docstring). Thread-safe."""

    def __init__(self, max_sessions: int = 4096, ttl_s: float = 3600.0) -> None:
        if max_sessions < 1 or ttl_s <= 0:
            raise ValueError(f"SessionStore: max_sessions >= 1 and ttl_s > 0, got {max_sessions}, {ttl_s}")
        self.max_sessions, self.ttl_s = max_sessions, ttl_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self.continued = 0
        self.restarts = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Optional[Session]:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return None
            if time.monotonic() - session.used > self.ttl_s:
                del self._sessions[session_id]
                return None
            self._sessions.move_to_end(session_id)
            return session

    def finish(self, session_id: str) -> bool:
        """Forget `session_id` (its trajectory is over); whether it was held."""
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def prompt_ids(self, codec: TextCodec, session_id: Optional[str], messages: list[dict[str, Any]],
                   tools: Optional[list[dict]], render: Optional[Render] = None) -> tuple[list[int], bool]:
        """The prompt of `messages` in `session_id`, and whether it continued the session's ids."""
        render = render or Render()
        session = self.get(session_id) if session_id and render.continuable else None
        if session is not None:
            ids = _continue(codec, session, messages, tools, render.template_kwargs)
            if ids is not None:
                self.continued += 1
                return ids, True
            self.restarts += 1
        return codec.chat_ids(messages, tools=tools, add_generation_prompt=render.add_generation_prompt,
                              continue_final_message=render.continue_final_message,
                              template_kwargs=render.template_kwargs), False

    def record(self, session_id: str, messages: list[dict[str, Any]], tools: Optional[list[dict]],
               prompt_ids: list[int], replies: list[Reply], render: Optional[Render] = None) -> None:
        render = render or Render()
        if not render.continuable:
            return
        session = Session(messages, tools, list(prompt_ids), replies, time.monotonic(), render.template_kwargs)
        with self._lock:
            self._sessions[session_id] = session
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)


def _continue(codec: TextCodec, session: Session, messages: list[dict[str, Any]], tools: Optional[list[dict]],
              template_kwargs: Optional[dict[str, Any]]) -> Optional[list[int]]:
    n = len(session.messages)
    if tools != session.tools or (template_kwargs or None) != (session.template_kwargs or None) \
            or len(messages) < n + 2 or messages[:n] != session.messages:
        return None
    reply = messages[n]
    calls = calls_of(reply.get("tool_calls") or [])
    if reply.get("role") != "assistant" or calls is None:
        return None
    text = message_text(reply)
    chosen = next((r for r in session.replies if r.shown == text and r.calls == calls), None)
    if chosen is None:
        return None
    return codec.continuation_ids(session.messages, session.prompt_ids, chosen.ids, reply, messages[n + 1:],
                                  tools=tools, template_kwargs=template_kwargs, reply_text=chosen.text)


def calls_of(tool_calls: list[Any]) -> Optional[tuple[Call, ...]]:
    """OpenAI's `tool_calls` as matched (None when one is not a function call with JSON arguments)."""
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return None
        arguments = function.get("arguments")
        try:
            out.append((function["name"], json.loads(arguments) if isinstance(arguments, str) else arguments))
        except ValueError:
            return None
    return tuple(out)
