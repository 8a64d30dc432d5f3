"""The waiting queue: requests not in a slot, in one FIFO lane per client, the clients taking turns.

A client is whoever submitted a request (a server passes its connection's identity); requests
submitted without one share the lane of `SHARED_CLIENT`, so a single caller sees plain FIFO.
Admission takes one request per client per turn (round robin over the lanes), so a client that
queued thousands of samples delays another client's request by one of its own, not by all of them.

What the scheduler puts back (preempted and requeued requests, samples whose fork failed, a group
whose leader left its slot) waits apart, in the `returning` lane, and is admitted before any
client's turn and without using one: it was admitted once already, and going first again is what
keeps an evicted request from being overtaken for ever (the scheduler's progress guarantee).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Optional

from inference.request import SHARED_CLIENT, Request

__all__ = ["SHARED_CLIENT", "WaitingQueue"]


class WaitingQueue:
    """Requests waiting for a slot: the returning lane, the clients' lanes and their turn order.

    Invariants: `_lanes` holds exactly the clients with at least one request in their lane, in turn
    order (the next turn first); a client's lane holds only its own requests, oldest first, none of
    which has been admitted before (all put back go to `returning`); `len()` counts every request
    in all lanes, `returning` included.
    """

    __slots__ = ("returning", "_lanes", "_size")

    def __init__(self) -> None:
        self.returning: deque[Request] = deque()  # put back by the scheduler, admitted first; read only
        self._lanes: OrderedDict[str, deque[Request]] = OrderedDict()
        self._size = 0  # requests in the client lanes

    def __len__(self) -> int:
        return self._size + len(self.returning)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request in the order admission looks at them within a lane: the returning
        lane, then each client's lane (in turn order), oldest first."""
        yield from self.returning
        for lane in self._lanes.values():
            yield from lane

    def __contains__(self, req: Request) -> bool:
        lane = self._lanes.get(req.client)
        return (lane is not None and req in lane) or req in self.returning

    # ---- changes -----------------------------------------------------------------------------

    def push(self, req: Request) -> None:
        """A new request: last in its client's lane (a client without one takes its turn last)."""
        lane = self._lanes.get(req.client)
        if lane is None:
            lane = self._lanes[req.client] = deque()
        lane.append(req)
        self._size += 1

    def push_returning(self, req: Request) -> None:
        """A request put back by the scheduler: first in the returning lane."""
        self.returning.appendleft(req)

    def replace(self, req: Request, successor: Optional[Request]) -> None:
        """`req` leaves the queue; `successor` (of the same client), if any, takes its place in line."""
        lane = self._lanes.get(req.client)
        if lane is None or req not in lane:
            lane = self.returning
        index = lane.index(req)  # NOTE: ValueError if it is not waiting
        if successor is not None:
            lane[index] = successor
            return
        del lane[index]
        if lane is not self.returning:
            self._size -= 1
            if not lane:
                del self._lanes[req.client]

    def clear(self) -> None:
        self.returning.clear()
        self._lanes.clear()
        self._size = 0

    # ---- admission ---------------------------------------------------------------------------

    def clients_in_turn(self, limit: int) -> list[str]:
        """The first `limit` clients with a lane, the next turn first."""
        out: list[str] = []
        for client in self._lanes:
            if len(out) == limit:
                break
            out.append(client)
        return out

    def take_returning(self, index: int) -> Request:
        """Admit the `index`-th request of the returning lane."""
        req = self.returning[index]
        del self.returning[index]
        return req

    def lane(self, client: str) -> deque[Request]:
        """The client's lane, oldest first (empty if none); read only."""
        return self._lanes.get(client, _EMPTY)

    def take(self, client: str, index: int) -> Request:
        """Admit the `index`-th request of the client's lane: its turn is over, it goes last."""
        lane = self._lanes[client]
        req = lane[index]
        del lane[index]
        self._size -= 1
        if lane:
            self._lanes.move_to_end(client)
        else:
            del self._lanes[client]
        return req

    def lane_lengths(self) -> dict[str, int]:
        """Requests in each client's lane (a group of n samples is one request), in turn order."""
        return {client: len(lane) for client, lane in self._lanes.items()}


_EMPTY: deque[Request] = deque(maxlen=0)
