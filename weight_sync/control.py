"""WeightControl: what a sender calls on a replica (or a router for all its replicas).

One update is one call: `update(source, policy)` carries the whole source (its manifest, with
the version it commits under) and returns the replica's policy version after it (unchanged while
a sequence of distributed calls stays open). The weight-update group of the gloo / NCCL
transports is joined and left with `join_group` / `leave_group`. `RolloutClient` implements it
over the wire; a test's in-process receiver can too. SGLang's names for the same calls
(`update_weights_from_distributed`, ...) are a facade over these (`rollout.client.weights`).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from weight_sync.sources import DEFAULT_GROUP, WeightSource


class WeightControl(Protocol):
    """Each call returns once the replica answered (or raises what it answered)."""

    def update(self, source: WeightSource, policy: Any = None) -> int: ...

    def join_group(self, master_address: str, master_port: int, rank_offset: Optional[int], world_size: int,
                   group_name: str = DEFAULT_GROUP, backend: Optional[str] = None, *,
                   timeout_s: Optional[float] = None) -> int: ...

    def leave_group(self, group_name: str = DEFAULT_GROUP) -> Any: ...

    def weight_version(self) -> int: ...


__all__ = ["WeightControl"]
