"""AsyncRolloutClient: `RolloutClient` for asyncio code (agent harnesses, async RL loops).

    async with AsyncRolloutClient("tcp://127.0.0.1:5555") as client:
        batch = await client.generate(prompts, n=8, sampling=params)
        async for item in client.stream(prompts, tokens=True):
            ...

Same connection underneath (an I/O thread owns the socket, heartbeats, reconnects); replies reach
the event loop through `call_soon_threadsafe`. Every awaitable is bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Optional, Protocol, Union

from inference import SamplingParams
from rollout.backend import Prompts, sort_rollouts
from rollout.client.connection import ControlPending
from rollout.client.remote import RemoteClient
from rollout.client.streams import StreamState
from rollout.client.weights import WeightSyncCalls
from rollout.control import Read
from rollout.text import TextCodec, token_prompts
from rollout.types import Rollout, RolloutBatch, TokenChunk
from rollout.wire import messages as wire


class AsyncSampleStream(StreamState):
    """The samples of one `AsyncRolloutClient.stream` call, as an async iterator (see
    `rollout.backend.SampleStream`); past its deadline the running samples are aborted."""

    def __init__(self, client: AsyncRolloutClient, prompts: Prompts, requests: list[wire.Generate], n: int,
                 timeout: float) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        sink = lambda item: loop.call_soon_threadsafe(self._queue.put_nowait, item)  # noqa: E731
        super().__init__(client, prompts, requests, n, timeout, sink)

    def __aiter__(self) -> AsyncIterator[Union[Rollout, TokenChunk]]:
        return self

    async def __anext__(self) -> Union[Rollout, TokenChunk]:
        if self.collector.done:
            raise StopAsyncIteration
        try:
            group, payload = await asyncio.wait_for(self._queue.get(), self.collector.wait_s())
        except asyncio.TimeoutError:
            raise self._timed_out() from None
        return self._accept(group, payload)

    async def result(self) -> list[Rollout]:
        return sort_rollouts([item async for item in self if isinstance(item, Rollout)])

    async def abort(self) -> None:
        pending = self.unfinished()
        if pending:
            await self._client.abort_requests(pending)


class AsyncClient(WeightSyncCalls, Protocol):
    """An asyncio client of an engine: `AsyncRolloutClient` over ZMQ, `InProcessClient`
    (`rollout.client.in_process`) in this process; the HTTP front runs on either. Each supplies
    `stream` (the samples as an async iterator); `generate`, `abort` and `policy_version` are
    written here once, the control calls in `rollout.control`, all awaited."""

    codec: Optional[TextCodec]

    def stream(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
               tokens: bool = False, timeout: Optional[float] = None, session_id: Optional[str] = None,
               group_id: Optional[str] = None) -> Any: ...

    async def generate(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
                       timeout: Optional[float] = None, session_id: Optional[str] = None,
                       group_id: Optional[str] = None) -> RolloutBatch:
        """As `rollout.RolloutBackend.generate`, awaited."""
        start = time.perf_counter()
        prompts = token_prompts(prompts, self.codec)
        rollouts = await self.stream(prompts, n, sampling, timeout=timeout, session_id=session_id,
                                     group_id=group_id).result()
        seconds = time.perf_counter() - start
        now = None if any(r.versions for r in rollouts) else await self.policy_version()
        return RolloutBatch.of_served(rollouts, prompts, n, seconds, lambda: now)

    async def abort(self, stream: Any) -> None:
        """Abort what still runs of `stream`; the aborted samples still come (reason `abort`)."""
        await stream.abort()

    async def policy_version(self, *, timeout: Optional[float] = None) -> int:
        return (await self.health(timeout=timeout)).policy_version


class AsyncRolloutClient(RemoteClient, AsyncClient):
    """The asyncio twin of `RolloutClient` (same arguments, same calls, awaited): the control calls
    of `rollout.control` and SGLang's weight-call names (`rollout.client.weights`)."""

    stream_class = AsyncSampleStream

    # ---- control (`rollout.control`): sent, and awaited by the caller ---------------------

    def _control(self, msg: wire.RequestMessage, timeout: Optional[float], read: Read) -> Awaitable[Any]:
        return self._reply(msg, self.timeout if timeout is None else timeout, read)

    async def _reply(self, msg: wire.RequestMessage, timeout: float, read: Read) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(fn, value) -> None:
            if not future.done():
                fn(value)

        self.connection.send(msg, ControlPending(
            lambda r: loop.call_soon_threadsafe(settle, future.set_result, r),
            lambda e: loop.call_soon_threadsafe(settle, future.set_exception, e)))
        try:
            return read(await asyncio.wait_for(future, timeout))
        except asyncio.TimeoutError:
            self.connection.forget([msg.request_id])
            raise TimeoutError(f"{type(msg).__name__} got no reply within {timeout} s") from None

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.connection.close)

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
