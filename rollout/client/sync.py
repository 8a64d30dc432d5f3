"""RolloutClient: a rollout server (`rollout serve`) behind the same interface as `RolloutEngine`.

    client = RolloutClient("tcp://127.0.0.1:5555")
    batch = client.generate(prompts, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=256))

Every call is safe from any thread and bounded by a timeout (`timeout=` per call, else the
client's). Each prompt travels as one `Generate` with an id the client chooses; the connection
(`rollout.client.connection`) heartbeats the client's lease and, after a reconnect, resubmits what is
unanswered under the same ids, so each sample arrives exactly once. `AsyncRolloutClient`
(`rollout.client.aio`) is the asyncio twin.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from inference import PauseMode, SamplingParams, SuspendPolicy, SuspendReport, UpdatePolicy
from rollout.backend import Prompts, WeightSource, params_per_prompt, sort_rollouts
from rollout.client.connection import Connection, ControlPending
from rollout.client.weights import WeightSyncCalls
from rollout.text import TextCodec, add_text, token_prompts
from rollout.types import GenerationStats, Rollout, RolloutBatch, TokenChunk
from rollout.wire import messages as wire
from rollout.wire.codec import encode, error_from_reply, output_from_wire, sampling_params_to_wire
from rollout.wire.security import ClientSecurity
from weight_sync import DistributedSource, SharedMemorySource

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
        if isinstance(msg, wire.SampleOutput):
            if msg.sample_index not in self.samples:
                self.samples.add(msg.sample_index)
                self.sink((self.group, msg))
            return len(self.samples) >= self.n
        if isinstance(msg, wire.TokenDelta):
            have = self.next_token.get(msg.sample_index, 0)
            end = msg.start + len(msg.token_ids)
            if end > have and msg.sample_index not in self.samples:
                self.next_token[msg.sample_index] = end
                self.sink((self.group, (msg, max(0, have - msg.start))))
            return False
        if isinstance(msg, wire.ErrorReply):
            self.sink((self.group, error_from_reply(msg)))
            return True
        return False

    def on_failure(self, error: BaseException) -> None:
        self.sink((self.group, error))


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
                                 sampling=sampling_params_to_wire(params), stream_tokens=tokens,
                                 session_id=session_id, group_id=group_id))
    return out


def to_item(prompts: Prompts, group: int, payload: Any) -> Union[Rollout, TokenChunk]:
    """A routed reply as what a stream yields (raises the error it carries)."""
    if isinstance(payload, BaseException):
        raise payload
    if isinstance(payload, wire.SampleOutput):
        return output_from_wire(payload, prompts[group], group)
    delta, cut = payload
    return TokenChunk(group, delta.sample_index, delta.start + cut, delta.token_ids[cut:].tolist(),
                      delta.logprobs[cut:].tolist(), delta.versions[cut:].tolist())


def control_message(kind: str, conn: Connection, **fields: Any) -> Any:
    """The control request for a backend call (names as in `RolloutBackend`)."""
    rid = conn.next_id("c")
    if kind == "pause":
        return wire.Pause(request_id=rid, mode=wire.PauseMode(PauseMode(fields["mode"]).value))
    if kind == "suspend":
        policy = fields["policy"]
        policy = wire.SuspendPolicy.RECOMPUTE if policy is None else wire.SuspendPolicy(SuspendPolicy(policy).value)
        return wire.Suspend(request_id=rid, policy=policy, offload_weights=bool(fields["offload_weights"]))
    if kind == "update_weights":
        source = fields["source"]
        if isinstance(source, (str, os.PathLike)):
            source = wire.SafetensorsDir(path=str(Path(source).absolute()))
        elif not isinstance(source, (DistributedSource, SharedMemorySource)):
            raise TypeError("a remote engine loads weights from a safetensors directory it can read (a path), or a "
                            f"weight_sync source (weight_sync.WeightSender sends those); got {type(source).__name__}")
        policy = fields["policy"]
        return wire.UpdateWeights(request_id=rid, source=source,
                                  target_version=fields["version"],
                                  policy=None if policy is None else wire.UpdatePolicy(UpdatePolicy(policy).value))
    simple = {"continue": wire.Continue, "resume": wire.Resume, "reset_prefix_cache": wire.ResetPrefixCache,
              "stats": wire.Stats, "health": wire.Health}
    return simple[kind](request_id=rid)


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


def suspend_report(stats: Optional[dict]) -> SuspendReport:
    fields = SuspendReport.__dataclass_fields__
    return SuspendReport(**{name: int((stats or {}).get(name, 0)) for name in fields})


class StreamState:
    """What a sample stream of either client keeps: its requests (sent at construction through
    `sink`), the samples still owed per request, and its deadline. Subclasses wait on their own
    queue and hand each `(group, payload)` to `_accept`."""

    def __init__(self, client: Any, prompts: Prompts, requests: list[wire.Generate], n: int, timeout: float,
                 sink: Sink) -> None:
        self._client = client
        self._codec = client.codec
        self._prompts = [list(map(int, p)) for p in prompts]
        self.request_ids = [g.request_id for g in requests]
        self._left = {g.request_id: n for g in requests}
        self._remaining = n * len(requests)
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        conn = client.connection
        frames = [encode(g, max_frame_bytes=conn.max_frame_bytes) for g in requests]  # all refused, or none
        for group, (g, frame) in enumerate(zip(requests, frames)):
            conn.send(g, GeneratePending(group, n, sink), frame=frame)

    def _wait_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _timed_out(self) -> TimeoutError:
        self._give_up()
        return TimeoutError(f"stream of {len(self.request_ids)} prompts not done within {self.timeout} s; "
                            "its running samples were aborted")

    def _accept(self, group: int, payload: Any) -> Union[Rollout, TokenChunk]:
        """The item of one queued payload; an error payload aborts the rest and is raised."""
        if isinstance(payload, BaseException):
            self._left[self.request_ids[group]] = 0
            self._give_up()
            raise payload
        item = to_item(self._prompts, group, payload)
        if isinstance(payload, wire.SampleOutput):
            self._remaining -= 1
            self._left[self.request_ids[group]] -= 1
            add_text([item], self._codec)
        return item

    def unfinished(self) -> list[str]:
        return [rid for rid, left in self._left.items() if left > 0]

    def _give_up(self) -> None:
        pending = self.unfinished()
        self._remaining = 0
        if pending:
            conn = self._client.connection
            conn.forget(pending)
            try:
                conn.send(wire.Abort(request_id=conn.next_id("a"), targets=pending), None)
            except ConnectionError:
                pass  # the client is closed: the server's lease aborts them


class RemoteSampleStream(StreamState):
    """The samples of one `RolloutClient.stream` call (see `rollout.backend.SampleStream`).

    Bounded by its deadline: past it, the running samples are aborted and `TimeoutError` raised.
    An error reply for one prompt (e.g. a token outside the vocabulary) aborts the others and is
    raised. Iterate from one thread.
    """

    def __init__(self, client: RolloutClient, prompts: Prompts, requests: list[wire.Generate], n: int,
                 timeout: float) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(client, prompts, requests, n, timeout, self._queue.put)

    def __iter__(self) -> Iterator[Union[Rollout, TokenChunk]]:
        return self

    def __next__(self) -> Union[Rollout, TokenChunk]:
        if self._remaining == 0:
            raise StopIteration
        try:
            group, payload = self._queue.get(timeout=self._wait_s())
        except queue.Empty:
            raise self._timed_out() from None
        return self._accept(group, payload)

    def result(self, timeout: Optional[float] = None) -> list[Rollout]:
        if timeout is not None:
            self.deadline = min(self.deadline, time.monotonic() + timeout)
        return sort_rollouts(item for item in self if isinstance(item, Rollout))

    def abort(self) -> None:
        pending = self.unfinished()
        if pending:
            self._client._call(wire.Abort(request_id=self._client.connection.next_id("a"), targets=pending), None)


class RolloutClient(WeightSyncCalls):
    """A remote engine behind `rollout.RolloutBackend` (see module docstring), with the weight-sync
    calls of `rollout.client.weights` (SGLang's names; what a `weight_sync.WeightSender` calls).

    `lease_s`: how long the server waits after this client falls silent before it aborts its
    requests (heartbeats every `lease_s / 4` keep it alive). `timeout`: the default bound of
    every call. `security`: the server's token or CURVE keys (`rollout.wire.security.ClientSecurity`).
    `tokenizer` (a model directory, an HF tokenizer or a `TextCodec`): text and chat prompts are
    encoded here, on the client, and every `Rollout` carries its decoded `text`.
    """

    def __init__(self, address: str, *, timeout: float = 300.0, lease_s: float = 10.0,
                 security: Optional[ClientSecurity] = None, reconnect_after_s: Optional[float] = None,
                 tokenizer: Any = None, **connection_options: Any) -> None:
        self.timeout = timeout
        self.codec: Optional[TextCodec] = None if tokenizer is None else TextCodec.load(tokenizer)
        self.connection = Connection(address, security=security, lease_s=lease_s,
                                     reconnect_after_s=reconnect_after_s, **connection_options)

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
                 timeout: Optional[float] = None, session_id: Optional[str] = None,
                 group_id: Optional[str] = None) -> RolloutBatch:
        """As `RolloutBackend.generate`; behind a router, `session_id` keeps a multi-turn agent's
        turns on one replica and `group_id` the prompts of this call (and of later calls with it);
        a server ignores both."""
        start = time.perf_counter()
        prompts = token_prompts(prompts, self.codec)
        rollouts = self.stream(prompts, n, sampling, timeout=timeout, session_id=session_id,
                               group_id=group_id).result()
        seconds = time.perf_counter() - start
        versions = [v for r in rollouts for v in r.versions]
        stats = GenerationStats(seconds=seconds, prompt_tokens=sum(len(p) for p in prompts),
                                completion_tokens=sum(len(r.completion_ids) for r in rollouts))
        version = min(versions) if versions else self.policy_version
        return RolloutBatch(rollouts, group_size=n, policy_version=version, stats=stats)

    def stream(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
               tokens: bool = False, timeout: Optional[float] = None, session_id: Optional[str] = None,
               group_id: Optional[str] = None) -> RemoteSampleStream:
        prompts = token_prompts(prompts, self.codec)
        requests = build_generates(self.connection, prompts, n, sampling, tokens, session_id, group_id)
        return RemoteSampleStream(self, prompts, requests, n, self.timeout if timeout is None else timeout)

    def abort(self, stream: RemoteSampleStream) -> None:
        stream.abort()

    # ---- control -------------------------------------------------------------------------------

    def _call(self, msg: Any, timeout: Optional[float]) -> wire.Result:
        return call_blocking(self.connection, msg, self.timeout if timeout is None else timeout)

    def _control(self, kind: str, timeout: Optional[float] = None, **fields: Any) -> wire.Result:
        return self._call(control_message(kind, self.connection, **fields), timeout)

    def pause(self, mode: Union[PauseMode, str] = PauseMode.KEEP, *, timeout: Optional[float] = None) -> None:
        self._control("pause", timeout, mode=mode)

    def continue_(self, *, timeout: Optional[float] = None) -> None:
        self._control("continue", timeout)

    def suspend(self, policy: Optional[SuspendPolicy] = None, *, offload_weights: bool = False,
                timeout: Optional[float] = None) -> SuspendReport:
        return suspend_report(self._control("suspend", timeout, policy=policy, offload_weights=offload_weights).stats)

    def resume(self, *, timeout: Optional[float] = None) -> None:
        self._control("resume", timeout)

    def update_weights(self, source: WeightSource, version: Optional[int] = None, *,
                       policy: Optional[UpdatePolicy] = None, timeout: Optional[float] = None) -> int:
        """Load the weights in the safetensors directory `source` (a path the server can read)."""
        return self._control("update_weights", timeout, source=source, version=version, policy=policy).policy_version

    def reset_prefix_cache(self, *, timeout: Optional[float] = None) -> None:
        self._control("reset_prefix_cache", timeout)

    @property
    def policy_version(self) -> int:
        return self.health().policy_version

    def health(self, *, timeout: Optional[float] = None) -> wire.HealthInfo:
        """Answered without the engine: whether its loop went round within the server's deadline."""
        return self._control("health", timeout).health

    def stats(self, *, timeout: Optional[float] = None) -> dict:
        return dict(self._control("stats", timeout).stats or {})

    # ---- connection ----------------------------------------------------------------------------

    def reconnect(self) -> None:
        """Replace the socket now; unanswered requests are resubmitted (answered exactly once)."""
        self.connection.reconnect()

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

