"""KV-cache events for an external router: which prefix blocks a replica can serve.

Stored events wait in a pending list until the forward pass that wrote their blocks succeeded
(`publish_pending`), or are dropped after a failed one (`discard_pending`). Removed and cleared
events go out at once. Consumers drain them (`take_events`) or register listeners; a listener
that raises is logged and never stops inference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Optional, Union

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks of one chain became matchable; `parent_block_hash` is 0 for a chain's root.

    `salt` and `version` are the chain's key (`BlockKey`: its cache salt, the version it is
    keyed by); `computed_by` the version whose weights computed these blocks.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int
    block_ids: tuple[int, ...]
    block_size: int
    salt: Optional[str] = None
    version: int = 0
    computed_by: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks with these hashes are no longer served."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """No block announced before this event is served any more (e.g. after a weight update)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
KVEventListener = Callable[[KVEvent], None]


class KVEventHub:
    """Collects KV events; disabled hubs (no drain, no listener) record nothing, at no cost.

    Invariant: a hash is announced as removed only if its stored event was published; removing
    a block whose stored event is still pending just drops that pending event.
    """

    def __init__(self, record: bool = False) -> None:
        self.record = record
        self._listeners: list[KVEventListener] = []
        self._pending: list[BlockStored] = []
        self._published: list[KVEvent] = []
        self._announced: set[int] = set()  # hashes published as stored and not yet removed

    @property
    def enabled(self) -> bool:
        return self.record or bool(self._listeners)

    def add_listener(self, listener: KVEventListener) -> None:
        self._listeners.append(listener)

    def queue_stored(self, event: BlockStored) -> None:
        if self.enabled:
            self._pending.append(event)

    def publish_pending(self) -> None:
        """The forward pass that wrote the pending blocks succeeded: announce them."""
        pending, self._pending = self._pending, []
        for event in pending:
            self._announced.update(event.block_hashes)
            self._emit(event)

    def discard_pending(self) -> None:
        """The forward pass failed: its blocks were never written, so never announce them."""
        self._pending.clear()

    def blocks_removed(self, hashes: Iterable[int]) -> None:
        if not self.enabled:
            return
        removed = set(hashes)
        if self._pending:
            self._drop_pending(removed)
        removed &= self._announced
        if removed:
            self._announced -= removed
            self._emit(BlockRemoved(tuple(sorted(removed))))

    def all_cleared(self) -> None:
        if self.enabled:
            self._pending.clear()
            self._announced.clear()
            self._emit(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        """Drain the published events, oldest first."""
        events, self._published = self._published, []
        return events

    def _drop_pending(self, removed: set[int]) -> None:
        """Remove `removed` from pending stored events: they will never be announced."""
        still_pending: list[BlockStored] = []
        for event in self._pending:
            kept = [(h, b) for h, b in zip(event.block_hashes, event.block_ids) if h not in removed]
            if kept:
                # NOTE: the chain's parent may have been dropped too; the router only needs hashes.
                hashes, ids = zip(*kept)
                still_pending.append(BlockStored(hashes, event.parent_block_hash, ids, event.block_size,
                                                 event.salt, event.version, event.computed_by))
        self._pending = still_pending

    def _emit(self, event: KVEvent) -> None:
        if self.record:
            self._published.append(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a router's failure must never stop inference
                logger.exception("KV event listener %r raised on %r; continuing", listener, event)
