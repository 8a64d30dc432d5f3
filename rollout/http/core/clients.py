"""What the HTTP front needs of its client (`FrontClient`), and the ZMQ one (`ServiceClient`).

The front runs on either, and does not know which:

* `ServiceClient`: `AsyncRolloutClient` over ZMQ, for a front in front of a `rollout serve`
  server or a `rollout route` router in another process (`rollout http --connect ADDRESS`);
* `rollout.client.in_process.InProcessClient`: the engine in this process, its calls posted to
  the engine's loop with no socket between (`rollout serve --http`).

Both answer alike: the same items on a stream, the same typed errors (so the same HTTP statuses),
the same health and stats keys. Weight calls go through the client too (`update_weights`,
`join_group`, `leave_group`, and SGLang's names over them, which its weight routes call).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Optional, Protocol, Union, runtime_checkable

from inference import SamplingParams
from rollout.backend import Prompts
from rollout.client.aio import AsyncClient, AsyncRolloutClient
from rollout.types import Rollout, TokenChunk


@runtime_checkable
class FrontStream(Protocol):
    """The samples of one `FrontClient.stream` call: `Rollout`s (and `TokenChunk`s when asked) as
    an async iterator, ending after the last sample; past its timeout it aborts and raises."""

    def __aiter__(self) -> AsyncIterator[Union[Rollout, TokenChunk]]: ...

    async def __anext__(self) -> Union[Rollout, TokenChunk]: ...

    def unfinished(self) -> list[str]:
        """The ids of the prompts whose samples have not all come."""

    async def abort(self) -> None:
        """Abort what still runs; the aborted samples still come (reason `abort`)."""

    # NOTE: the name the clients' shared stream plumbing gives it (rollout.client.streams.StreamState)
    def _give_up(self) -> None:
        """Stop reading: abort what still runs without waiting, and end the iteration."""


@runtime_checkable
class FrontClient(AsyncClient, Protocol):
    """What `HttpFront` calls: an asyncio client (`rollout.client.aio.AsyncClient`: generation, the
    control calls of `rollout.control` with SGLang's weight-call names, each awaited) whose stream
    is a `FrontStream`. Every call is bounded by `timeout` (None: the client's own); none blocks
    the event loop."""

    def stream(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
               tokens: bool = False, timeout: Optional[float] = None, session_id: Optional[str] = None,
               group_id: Optional[str] = None) -> FrontStream: ...


# the front's client of a server or router over ZMQ: `AsyncRolloutClient`, whose control calls
# (`rollout.control`) include the weight-update group's
ServiceClient = AsyncRolloutClient
