"""A version-only update (`VersionSource`): nothing moves, the weights serve under a new version.

It still goes through the receiver's staged update (one update at a time, the version checked to
grow, the update policy applied to requests in flight, the prefix cache reset by the commit), so a
version never changes beside another update, and tokens sampled after it carry the new version.
The trainer side is the caller of `/update_weight_version`; there is no sender.
"""

from __future__ import annotations

from typing import Any

from weight_sync.sources import VersionSource


class VersionTransport:
    transports = ()  # NOTE: no bytes, no `Transport` to choose
    source_type = VersionSource

    def send(self, *args: Any, **kwargs: Any) -> int:
        raise TypeError("a version-only update has no sender: a replica is told its new version (VersionSource)")

    def receive(self, receiver: Any, source: VersionSource, policy: Any) -> int:
        """Commit `source.version` with no tensor loaded (a partial update of nothing)."""
        return receiver.staged(source.version, None, policy, lambda: None, partial=True)
