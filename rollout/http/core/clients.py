"""What the HTTP front needs of its client (`FrontClient`), and the ZMQ one (`ServiceClient`).

The front runs on either, and does not know which:

* `ServiceClient`: `AsyncRolloutClient` over ZMQ, for a front in front of a `rollout serve`
  server or a `rollout route` router in another process (`rollout http --connect ADDRESS`);
* `rollout.client.in_process.InProcessClient`: the engine in this process, its calls posted to
  the engine's loop with no socket between (`rollout serve --http`).

Both answer alike: the same items on a stream, the same typed errors (so the same HTTP statuses),
the same health and stats keys. Weight calls go through the client too (`update_weights`,
`join_group`, `leave_group`); `rollout.http.core.weights` maps SGLang's routes onto them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Optional, Protocol, Union, runtime_checkable

from inference import PauseMode, SamplingParams, SuspendPolicy, SuspendReport, UpdatePolicy
from rollout.backend import Prompts, WeightSource
from rollout.client.aio import AsyncRolloutClient
from rollout.types import Rollout, RolloutBatch, TokenChunk
from rollout.wire import messages as wire
from weight_sync import DEFAULT_GROUP


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
class FrontClient(Protocol):
    """What `HttpFront` calls: generation, engine control, health and stats, weight updates.
    Every call is bounded by `timeout` (None: the client's own); none blocks the event loop."""

    def stream(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
               tokens: bool = False, timeout: Optional[float] = None, session_id: Optional[str] = None,
               group_id: Optional[str] = None) -> FrontStream: ...

    async def generate(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
                       timeout: Optional[float] = None, session_id: Optional[str] = None,
                       group_id: Optional[str] = None) -> RolloutBatch: ...

    async def abort(self, stream: Any) -> None: ...

    async def pause(self, mode: Union[PauseMode, str] = PauseMode.KEEP, *, timeout: Optional[float] = None
                    ) -> None:
        """WAIT returns once what was admitted has finished; the other modes at once."""

    async def continue_(self, *, timeout: Optional[float] = None) -> None: ...

    async def suspend(self, policy: Optional[SuspendPolicy] = None, *, offload_weights: bool = False,
                      tags: Optional[Sequence[str]] = None, discard_weights: bool = False,
                      timeout: Optional[float] = None) -> SuspendReport: ...

    async def resume(self, *, tags: Optional[Sequence[str]] = None, timeout: Optional[float] = None) -> None: ...

    async def reset_prefix_cache(self, *, timeout: Optional[float] = None) -> None: ...

    async def policy_version(self, *, timeout: Optional[float] = None) -> int: ...

    async def health(self, *, timeout: Optional[float] = None) -> wire.HealthInfo: ...

    async def stats(self, *, timeout: Optional[float] = None) -> dict:
        """The server's `Stats` keys: `engine/*`, the headline keys, counters, `weight_sync/*`."""

    async def update_weights(self, source: WeightSource, version: Optional[int] = None, *,
                             policy: Optional[UpdatePolicy] = None, timeout: Optional[float] = None) -> int:
        """One whole update from `source`; the policy version after it."""

    async def join_group(self, master_address: str, master_port: int, rank_offset: Optional[int], world_size: int,
                         group_name: str = DEFAULT_GROUP, backend: Optional[str] = None, *,
                         timeout_s: Optional[float] = None, timeout: Optional[float] = None) -> int:
        """Join the trainer's weight-update group; this replica's rank."""

    async def leave_group(self, group_name: str = DEFAULT_GROUP, *, timeout: Optional[float] = None) -> None: ...

    async def load_lora(self, name: str, path: str, *, timeout: Optional[float] = None) -> wire.LoraInfo:
        """Load the PEFT adapter in directory `path` as `name` (again: its next version)."""

    async def unload_lora(self, name: str, *, timeout: Optional[float] = None) -> None: ...

    async def list_loras(self, *, timeout: Optional[float] = None) -> list[wire.LoraInfo]: ...


# the front's client of a server or router over ZMQ: `AsyncRolloutClient`, whose control calls
# (`rollout.client.control`) include the weight-update group's
ServiceClient = AsyncRolloutClient
