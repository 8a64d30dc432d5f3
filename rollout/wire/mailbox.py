"""Mailbox: items from any thread to the one thread that owns a ZMQ socket, with a pollable wake-up.

ZMQ sockets are not thread-safe, so the thread that owns one (the server's ROUTER, a client's
DEALER) never hands it out; other threads `put` what it should do or send into a mailbox, and
the owner polls `fileno()` together with its socket (`zmq.Poller` takes plain file descriptors),
then `drain()`s. The wake-up is one byte on a local socket pair, written only when the mailbox
goes from "nothing signalled" to "signalled", so a burst of puts costs one wake-up.
"""

from __future__ import annotations

import socket
from collections import deque
from typing import Any


class Mailbox:
    """Thread-safe queue with a file descriptor that is readable while items may be waiting.

    Invariant: an item put is seen by a later `drain()`; after `put` the descriptor is readable
    until the next `drain()` (never a lost wake-up; at worst a spurious one, which drains nothing).
    """

    def __init__(self) -> None:
        self._items: deque[Any] = deque()  # NOTE: deque.append / popleft are atomic under the GIL
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._signalled = False
        self._closed = False

    def fileno(self) -> int:
        return self._reader.fileno()

    def put(self, item: Any) -> None:
        """From any thread: queue `item` and wake the owner."""
        self._items.append(item)
        if not self._signalled:
            self._signalled = True
            try:
                self._writer.send(b"\0")
            except (BlockingIOError, OSError):  # full (the owner is behind, it will drain) or closed
                pass

    def drain(self) -> list[Any]:
        """On the owning thread: every item queued so far, in order.

        NOTE: the order is what keeps the invariant: wake-up bytes consumed first, then the flag
        cleared, then items popped. A put between the first two finds the flag set and sends
        nothing, but its item is popped below; one after the clear sends a byte nothing here
        consumes (a spurious wake-up at worst). Clearing before reading would let the read eat
        that byte and leave the flag set with no byte pending: every later put would send none.
        """
        try:
            while self._reader.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._signalled = False
        items = []
        while True:
            try:
                items.append(self._items.popleft())
            except IndexError:
                return items

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._reader.close()
            self._writer.close()
