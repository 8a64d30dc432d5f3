"""How a staged weight update is held until it commits: the staging kind (the wire reuses it) and
the record of an update in progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch


class Staging(str, enum.Enum):
    """Where a staged update's tensors go until it commits (see `manager.py`'s docstring)."""

    DOUBLE = "double"
    IN_PLACE = "in_place"


@dataclass(frozen=True, slots=True)
class OpenUpdate:
    """What an open staged update says of itself to whoever feeds it (a weight receiver, across
    calls): which update it is (`serial`, new for each one opened), the version it commits under,
    the channel feeding it (`origin`, e.g. a weight-update group's name) and whether it stays open
    until an explicit commit (`held`: vLLM's start phase) rather than once every tensor is in."""

    serial: int
    version: Optional[int]
    origin: str
    held: bool


@dataclass(slots=True)
class StagedUpdate:
    """An open staged update, owned by `WeightManager`: what was loaded, and where it went. The
    only record of an update in progress: its feeder reads back `opened`."""

    opened: OpenUpdate
    staging: Staging
    partial: bool
    retain_staging: bool = False
    loaded: set[str] = field(default_factory=set)
    staged: dict[str, torch.Tensor] = field(default_factory=dict)  # DOUBLE: the copies to swap in
    handed: dict[str, torch.Tensor] = field(default_factory=dict)  # DOUBLE: buffers a transport fills itself
