"""The engine's states, the memory parts a suspend frees, and the outputs it hands to its client."""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection
from typing import Optional

from inference.request import RequestOutput, TokenEvent


class MemoryTag(str, enum.Enum):
    """A part of the engine's memory that suspend frees on its own (vLLM's sleep tags, SGLang's);
    the value is the tag's name over HTTP and on the wire."""

    KV_CACHE = "kv_cache"  # the KV and state buffers, the step workspaces
    WEIGHTS = "weights"  # the engine's own weight storage (and resident LoRA adapters)


MEMORY_TAGS = tuple(tag.value for tag in MemoryTag)  # the tags' names, as a client spells them


def memory_parts(tags: Optional[Collection[str]], weights: bool) -> set[MemoryTag]:
    """The parts a suspend (or resume) names: `tags` (`MemoryTag`s or their names), checked; None:
    the KV cache, and the weights too with `weights` (the router reads a `Suspend` message the same way)."""
    if tags is None:
        return set(MemoryTag) if weights else {MemoryTag.KV_CACHE}
    if isinstance(tags, str):
        tags = [tags]
    if not tags or any(tag not in MEMORY_TAGS for tag in tags):  # NOTE: a MemoryTag equals its name
        raise ValueError(f"tags must name some of {list(MEMORY_TAGS)}, got {sorted(map(str, tags))}")
    return {MemoryTag(tag) for tag in tags}


class EngineState(str, enum.Enum):
    """RUNNING steps; PAUSED holds (or, in WAIT mode, drains) what is in flight and queues new
    requests; SUSPENDED has handed its KV buffer (and maybe its weights) to the trainer."""

    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"


OnFinished = Callable[[RequestOutput], None]
OnTokens = Callable[[list[TokenEvent]], None]
