"""Bounded scalar types, checked as msgspec decodes a frame or a struct: one definition each, shared by
the engine's `SamplingParams`, the weight manifests and the wire's messages."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

NonNegInt = Annotated[int, Meta(ge=0)]  # a token id, a count, a version, an offset
