"""The expert-parallel group's CPU-side step agreement, over ZMQ (megatron-core's EP ZMQ communicator).

Every EP rank must run every step together (the MoE all-to-alls hang otherwise) with the same
padded shape. Before each step the ranks reduce their batch dimensions with `sync_all_reduce_max`:
a few integers, on the CPU, so no all-reduce kernel lands on the compute stream and an idle rank
learns what dummy batch to run.

Topology: rank 0 is the hub (a ROUTER bound to `address`, loopback by default); the others connect
DEALERs. A round: each rank sends `[round, values]`; the hub waits for all of them, takes the
element-wise MAX and answers each. Messages are msgpack lists of ints (no pickle).

Failure: a peer that disappears never leaves the others hanging. The hub that misses a rank's
contribution for `timeout_s` tells the ranks that did arrive and raises `EPPeerLostError` naming
the missing ranks; a rank whose hub stays silent raises it too, after a grace period past
`timeout_s` (so the hub's error, which names the lost rank, reaches it first when the hub lives). After an error the
communicator is closed: the group is broken and must be rebuilt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import msgpack
import zmq

logger = logging.getLogger(__name__)

_HELLO, _SYNC, _RESULT, _ERROR = 0, 1, 2, 3


class EPPeerLostError(RuntimeError):
    """An expert-parallel peer did not take part in a step agreement within the timeout."""


class EPCommunicator:
    """One rank's end of the EP group's ZMQ agreement (see module docstring).

    Invariant: every rank calls `sync_all_reduce_max` the same number of times (one round per
    engine step); round numbers are checked, so a rank out of step fails loudly.
    """

    def __init__(self, rank: int, world_size: int, address: str, *, timeout_s: float = 30.0,
                 connect_timeout_s: float | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"EPCommunicator: rank {rank} is not in a group of {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"EPCommunicator.timeout_s must be positive, got {timeout_s}")
        self.rank, self.world_size, self.address, self.timeout_s = rank, world_size, address, timeout_s
        self.round = 0
        self.closed = False
        self._ctx = zmq.Context.instance()
        self._peers: list[bytes] = []
        if world_size == 1:
            self._sock = None
            return
        self._sock = self._ctx.socket(zmq.ROUTER if rank == 0 else zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if rank == 0:
            self._sock.bind(address)
        else:
            self._sock.setsockopt(zmq.IDENTITY, str(rank).encode())
            self._sock.connect(address)
        self._handshake(connect_timeout_s if connect_timeout_s is not None else timeout_s)

    # ---- wire --------------------------------------------------------------------------------

    def _send(self, payload: list, to: bytes | None = None) -> None:
        frames = [msgpack.packb(payload)]
        self._sock.send_multipart(frames if to is None else [to, *frames])

    def _recv(self, deadline: float) -> tuple[bytes | None, list] | None:
        """(sender identity on the hub, payload), or None at the deadline."""
        left = deadline - time.monotonic()
        if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
            return None
        frames = self._sock.recv_multipart()
        sender, body = (frames[0], frames[-1]) if self.rank == 0 else (None, frames[-1])
        payload = msgpack.unpackb(body)
        if not isinstance(payload, list) or not payload or not isinstance(payload[0], int):
            raise EPPeerLostError(f"EP rank {self.rank}: malformed message from {sender!r}")
        return sender, payload

    def _fail(self, message: str) -> EPPeerLostError:
        logger.error(message)
        self.close()
        return EPPeerLostError(message)

    # ---- handshake ---------------------------------------------------------------------------

    def _handshake(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        if self.rank != 0:
            self._send([_HELLO, self.rank])
            got = self._recv(deadline)
            if got is None or got[1][0] != _HELLO:
                raise self._fail(f"EP rank {self.rank}: the hub (rank 0) at {self.address} did not answer within "
                                 f"{timeout_s:.1f} s")
            return
        seen: dict[int, bytes] = {}
        while len(seen) < self.world_size - 1:
            got = self._recv(deadline)
            if got is None:
                missing = sorted(set(range(1, self.world_size)) - set(seen))
                raise self._fail(f"EP hub: ranks {missing} did not connect to {self.address} within {timeout_s:.1f} s")
            sender, payload = got
            if payload[0] == _HELLO:
                seen[int(payload[1])] = sender
        self._peers = [seen[r] for r in range(1, self.world_size)]
        for peer in self._peers:
            self._send([_HELLO, 0], peer)

    # ---- the agreement -----------------------------------------------------------------------

    def sync_all_reduce_max(self, values: Sequence[int]) -> list[int]:
        """The element-wise MAX of every rank's `values` (same length on all ranks); blocks until
        all ranks contributed. Raises `EPPeerLostError` when a peer does not within `timeout_s`."""
        if self.closed:
            raise EPPeerLostError(f"EP rank {self.rank}: the communicator is closed (a peer was lost before)")
        values = [int(v) for v in values]
        self.round += 1
        if self._sock is None:
            return values
        start = time.monotonic()
        deadline = start + self.timeout_s
        if self.rank != 0:
            deadline += max(0.5, 0.5 * self.timeout_s)  # NOTE: the grace period (module docstring)
            self._send([_SYNC, self.round, values])
            while True:
                got = self._recv(deadline)
                if got is None:
                    raise self._fail(f"EP rank {self.rank}: the hub (rank 0) did not answer step round {self.round} "
                                     f"within {deadline - start:.1f} s (gone?)")
                payload = got[1]
                if payload[0] == _ERROR:
                    raise self._fail(f"EP rank {self.rank}: {payload[1]}")
                if payload[0] == _RESULT and payload[1] == self.round:
                    return [int(v) for v in payload[2]]
        result, arrived = list(values), {0}
        while len(arrived) < self.world_size:
            got = self._recv(deadline)
            if got is None:
                missing = sorted(set(range(self.world_size)) - arrived)
                raise self._broadcast_failure(f"EP ranks {missing} did not reach step round {self.round} within "
                                              f"{self.timeout_s:.1f} s (gone?)", arrived)
            sender, payload = got
            if payload[0] != _SYNC:
                continue
            rank = int(sender.decode())
            if payload[1] != self.round or len(payload[2]) != len(values):
                raise self._broadcast_failure(f"rank {rank} sent round {payload[1]} with {len(payload[2])} values, "
                                              f"expected round {self.round} with {len(values)} (out of step)",
                                              arrived | {rank})
            arrived.add(rank)
            result = [max(a, int(b)) for a, b in zip(result, payload[2])]
        for peer in self._peers:
            self._send([_RESULT, self.round, result], peer)
        return result

    def _broadcast_failure(self, message: str, told: set[int]) -> EPPeerLostError:
        """The hub tells the ranks in `told` (those waiting for its answer) why the round failed."""
        for r in sorted(told - {0}):
            self._send([_ERROR, message], self._peers[r - 1])
        return self._fail(f"EP hub: {message}")

    def close(self) -> None:
        if self._sock is not None and not self.closed:
            self._sock.close(linger=0)
        self.closed = True

    def __repr__(self) -> str:
        return f"EPCommunicator(rank {self.rank} of {self.world_size}, {self.address}, round {self.round})"
