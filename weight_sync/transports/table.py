"""Which object moves an update: by `Transport` (a sender's choice) or by the type of the source a
replica is told to read. Each object has both sides of its transport:

* `send(sender, named, version, policy) -> bytes moved`, with the `WeightSender`'s options, state
  and fan-out (`each`, `collect`, `move_then_collect`);
* `receive(receiver, source, policy) -> the version committed, or None (a sequence stays open)`,
  inside the `WeightReceiver`'s one-update-at-a-time lock, through its staged update.

`DELTA` rides the in-memory transports: a sender in delta mode calls its `send` (with the base it
last sent) in place of its transport's when every replica holds that base.
"""

from __future__ import annotations

from weight_sync.transports.bucket_broadcast import DistributedTransport
from weight_sync.transports.delta import DeltaTransport
from weight_sync.transports.disk import DiskTransport
from weight_sync.transports.shared_memory import SharedMemoryTransport
from weight_sync.transports.version_only import VersionTransport

DELTA = DeltaTransport()
TRANSPORT_OBJECTS = (DistributedTransport(), SharedMemoryTransport(), DiskTransport(), DELTA, VersionTransport())
BY_TRANSPORT = {transport: obj for obj in TRANSPORT_OBJECTS for transport in obj.transports}
BY_SOURCE = {obj.source_type: obj for obj in TRANSPORT_OBJECTS}

__all__ = ["BY_SOURCE", "BY_TRANSPORT", "DELTA", "TRANSPORT_OBJECTS"]
