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

import queue
import time
from collections.abc import Iterator
from typing import Any, Optional, Union

from inference import SamplingParams
from rollout.backend import Prompts, sort_rollouts
from rollout.client.remote import RemoteClient
from rollout.client.streams import StreamState, call_blocking
from rollout.control import Read
from rollout.text import token_prompts
from rollout.types import Rollout, RolloutBatch, TokenChunk
from rollout.wire import messages as wire


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
        if self.collector.done:
            raise StopIteration
        try:
            group, payload = self._queue.get(timeout=self.collector.wait_s())
        except queue.Empty:
            raise self._timed_out() from None
        return self._accept(group, payload)

    def result(self, timeout: Optional[float] = None) -> list[Rollout]:
        self.collector.within(timeout)
        return sort_rollouts(item for item in self if isinstance(item, Rollout))

    def abort(self) -> None:
        pending = self.unfinished()
        if pending:
            self._client.abort_requests(pending)


class RolloutClient(RemoteClient):
    """A remote engine behind `rollout.RolloutBackend` (see module docstring; its arguments:
    `rollout.client.remote.RemoteClient`): the control calls of `rollout.control` (those of
    `weight_sync.WeightControl`, what a `WeightSender` calls, among them), blocking, and SGLang's
    names for the weight calls (`rollout.client.weights`)."""

    stream_class = RemoteSampleStream

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
        return RolloutBatch.of_served(rollouts, prompts, n, time.perf_counter() - start, lambda: self.policy_version)

    # ---- control (`rollout.control`): sent, and waited for here ------------------------

    def _call(self, msg: wire.RequestMessage, timeout: Optional[float]) -> wire.Result:
        """Send `msg` and wait for its reply (None: the client's timeout); an error reply is raised."""
        return call_blocking(self.connection, msg, self.timeout if timeout is None else timeout)

    def _control(self, msg: wire.RequestMessage, timeout: Optional[float], read: Read) -> Any:
        return read(self._call(msg, timeout))

    @property
    def policy_version(self) -> int:
        return self.health().policy_version

    # ---- connection ----------------------------------------------------------------------------

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
