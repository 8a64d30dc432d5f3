"""What both clients share to send Generates and collect their replies: the per-request pending
(on the connection's I/O thread), the stream's bookkeeping, building the Generates, and one
blocking control call."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import numpy as np

from inference import SamplingParams
from rollout.backend import Prompts, params_per_prompt
from rollout.client.connection import Connection, ControlPending
from rollout.collector import SampleCollector
from rollout.text import add_text
from rollout.types import Rollout, TokenChunk
from rollout.wire import messages as wire
from rollout.wire.codec import encode
from rollout.wire.convert import error_from_reply, output_from_wire

Sink = Callable[[tuple[int, Any]], None]


class GeneratePending:
    """The replies to one Generate, on the connection's I/O thread: each sample index once (the
    first copy; a resubmission may bring it again), token deltas without repeats, or an error."""

    __slots__ = ("group", "n", "samples", "next_token", "sink")

    def __init__(self, group: int, n: int, sink: Sink) -> None:
        self.group, self.n, self.sink = group, n, sink
        self.samples: set[int] = set()
        self.next_token: dict[int, int] = {}

    def on_reply(self, msg: Any) -> bool:
        """Whether the Generate is answered in full now (every sample, or an error)."""
        handle = _ON_REPLY.get(type(msg))
        return handle(self, msg) if handle is not None else False

    def _sample(self, msg: wire.SampleOutput) -> bool:
        if msg.sample_index not in self.samples:
            self.samples.add(msg.sample_index)
            self.sink((self.group, msg))
        return len(self.samples) >= self.n

    def _tokens(self, msg: wire.TokenDelta) -> bool:
        have = self.next_token.get(msg.sample_index, 0)
        end = msg.start + len(msg.token_ids)
        if end > have and msg.sample_index not in self.samples:
            self.next_token[msg.sample_index] = end
            self.sink((self.group, (msg, max(0, have - msg.start))))
        return False

    def _refused(self, msg: wire.ErrorReply) -> bool:
        self.sink((self.group, error_from_reply(msg)))
        return True

    def on_failure(self, error: BaseException) -> None:
        self.sink((self.group, error))


# the replies a Generate gets, each to its one handler (a Result is not one: ignored)
_ON_REPLY: dict[type, Callable[[GeneratePending, Any], bool]] = {
    wire.SampleOutput: GeneratePending._sample, wire.TokenDelta: GeneratePending._tokens,
    wire.ErrorReply: GeneratePending._refused,
}


def build_generates(conn: Connection, prompts: Prompts, n: int, sampling: Optional[SamplingParams],
                    tokens: bool, session_id: Optional[str] = None, group_id: Optional[str] = None
                    ) -> list[wire.Generate]:
    """One Generate per prompt, ids from the connection's session (checked here, not on the wire);
    `session_id` / `group_id` are routing hints for a router (a server ignores them)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
    out = []
    for params, prompt in zip(params_per_prompt(len(prompts), n, sampling), prompts):
        out.append(wire.Generate(request_id=conn.next_id(), prompt_token_ids=np.asarray(prompt),
                                 sampling=params, stream_tokens=tokens,
                                 session_id=session_id or params.session_id, group_id=group_id))
    return out


def with_prompt_logprobs(rollout: Rollout, sample: wire.SampleOutput) -> Rollout:
    """`rollout` with the sample's prompt log-probs (NOTE: set here, not in `output_from_wire`,
    while the wire package is being changed elsewhere; they belong there)."""
    if sample.prompt_logprobs is not None:
        rollout.prompt_logprobs = [None if d is None else dict(d) for d in sample.prompt_logprobs]
        rollout.prompt_logprob_ranks = sample.prompt_logprob_ranks
    return rollout


def to_item(prompts: Prompts, group: int, payload: Any) -> Union[Rollout, TokenChunk]:
    """A routed reply as what a stream yields (raises the error it carries)."""
    if isinstance(payload, BaseException):
        raise payload
    if isinstance(payload, wire.SampleOutput):
        return with_prompt_logprobs(output_from_wire(payload, prompts[group], group), payload)
    delta, cut = payload
    return TokenChunk(group, delta.sample_index, delta.start + cut, delta.token_ids[cut:].tolist(),
                      delta.logprobs[cut:].tolist(), delta.versions[cut:].tolist())


def call_blocking(connection: Connection, msg: Any, timeout: float) -> wire.Result:
    """Send one control message and wait for its reply (an error reply is raised); past `timeout`
    the request is forgotten and `TimeoutError` raised."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    connection.send(msg, ControlPending(future.set_result, future.set_exception))
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        connection.forget([msg.request_id])
        raise TimeoutError(f"{type(msg).__name__} got no reply within {timeout} s") from None


class StreamState:
    """What a sample stream of either client keeps: its requests (sent at construction through
    `sink`) and their `SampleCollector` (samples owed, the deadline). Subclasses wait on their own
    queue and hand each `(group, payload)` to `_accept`."""

    def __init__(self, client: Any, prompts: Prompts, requests: list[wire.Generate], n: int, timeout: float,
                 sink: Sink) -> None:
        self._client = client
        self._codec = client.codec
        self._prompts = [list(map(int, p)) for p in prompts]
        self.collector = SampleCollector([g.request_id for g in requests], [n] * len(requests), timeout)
        self.request_ids = self.collector.request_ids
        conn = client.connection
        frames = [encode(g, max_frame_bytes=conn.max_frame_bytes) for g in requests]  # all refused, or none
        for group, (g, frame) in enumerate(zip(requests, frames)):
            conn.send(g, GeneratePending(group, n, sink), frame=frame)

    def _timed_out(self) -> TimeoutError:
        self._give_up()
        return TimeoutError(f"stream of {len(self.request_ids)} prompts not done within {self.collector.timeout} s; "
                            "its running samples were aborted")

    def _accept(self, group: int, payload: Any) -> Union[Rollout, TokenChunk]:
        """The item of one queued payload; an error payload aborts the rest and is raised."""
        if isinstance(payload, BaseException):
            self.collector.refuse(group)
            self._give_up()
            raise payload
        item = to_item(self._prompts, group, payload)
        if isinstance(payload, wire.SampleOutput):
            self.collector.take(group, payload.sample_index)
            add_text([item], self._codec)
        return item

    def unfinished(self) -> list[str]:
        return self.collector.unfinished()

    def _give_up(self) -> None:
        pending = self.collector.give_up()
        if pending:
            conn = self._client.connection
            conn.forget(pending)
            try:
                conn.send(wire.Abort(request_id=conn.next_id("a"), targets=pending), None)
            except ConnectionError:
                pass  # the client is closed: the server's lease aborts them
