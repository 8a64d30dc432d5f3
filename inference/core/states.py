"""The engine's states and the outputs it hands to its client."""

from __future__ import annotations

import enum
from collections.abc import Callable

from inference.request import RequestOutput, TokenEvent


class EngineState(enum.Enum):
    """RUNNING steps; PAUSED holds (or, in WAIT mode, drains) what is in flight and queues new
    requests; SUSPENDED has handed its KV buffer (and maybe its weights) to the trainer."""

    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"


OnFinished = Callable[[RequestOutput], None]
OnTokens = Callable[[list[TokenEvent]], None]
