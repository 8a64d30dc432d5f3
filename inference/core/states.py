"""The engine's states, the memory parts a suspend frees, and the outputs it hands to its client."""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection
from typing import Optional

from inference.request import RequestOutput, TokenEvent

MEMORY_TAGS = ("kv_cache", "weights")  # what suspend frees, part by part (vLLM's sleep tags, SGLang's)


def memory_parts(tags: Optional[Collection[str]], weights: bool) -> set[str]:
    """The parts a suspend (or resume) names: `tags`, checked; None: the KV cache, and the weights
    too with `weights` (the router reads a `Suspend` message the same way)."""
    if tags is None:
        return set(MEMORY_TAGS) if weights else {"kv_cache"}
    if isinstance(tags, str):
        tags = [tags]
    parts = set(tags)
    if parts - set(MEMORY_TAGS) or not parts:
        raise ValueError(f"tags must name some of {list(MEMORY_TAGS)}, got {sorted(map(str, tags))}")
    return parts


class EngineState(enum.Enum):
    """RUNNING steps; PAUSED holds (or, in WAIT mode, drains) what is in flight and queues new
    requests; SUSPENDED has handed its KV buffer (and maybe its weights) to the trainer."""

    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"


OnFinished = Callable[[RequestOutput], None]
OnTokens = Callable[[list[TokenEvent]], None]
