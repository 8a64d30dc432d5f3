"""A replica's prefix-cache events on the wire (the reply to `KvEvents`, `rollout.wire.messages`),
for a router's prefix-aware placement."""

from __future__ import annotations

import enum
from typing import Annotated, Optional

import msgspec
from msgspec import Meta

from inference.bounded import NonNegInt

BlockHash = Annotated[int, Meta(ge=1, le=2**63 - 1)]


class KvOp(enum.IntEnum):
    """A prefix-cache event of a replica (`inference.kv_cache.events`), for routers."""

    STORED = 1  # these block hashes became matchable
    REMOVED = 2  # these are no longer served
    CLEARED = 3  # nothing announced before is served any more (a reset, a weight update, suspend)


class KvEvent(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """`salt`, `version` (the key the blocks' chain is hashed under) and `computed_by` (the
    version whose weights computed them) are set on STORED events."""

    op: KvOp
    hashes: list[BlockHash] = []
    salt: Optional[str] = None
    version: Optional[NonNegInt] = None
    computed_by: Optional[NonNegInt] = None


class KvEventBatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Events `start`, `start + 1`, ... of a replica's log; poll again with `since=next`.

    `reset`: events between the poller's `since` and `start` were lost (the log is bounded, or
    the replica restarted): drop everything believed about its cache, then apply these. `more`:
    the log holds events past `next` (the reply was cut to fit a frame). `block_size` is the
    replica's, which a router needs to hash prompts as it does.
    """

    block_size: Annotated[int, Meta(ge=1)]
    start: NonNegInt
    next: NonNegInt
    reset: bool = False
    more: bool = False
    events: list[KvEvent] = []
