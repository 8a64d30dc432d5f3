"""A non-streaming answer's wait, cut short when its client goes away.

A streaming response notices a client gone at its next write (Starlette cancels the stream, and a
`Generation` aborts its engine requests as it unwinds). A non-streaming route writes only at the
end, so without this the engine would run every sample of an abandoned request to its last token
and hold its KV blocks meanwhile. `unless_disconnected` races the wait against the client's
disconnect (uvicorn's `http.disconnect`, which `receive()` returns once the body is read and the
socket closes) and cancels the wait when the client wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from rollout.http.core.errors import APIError

logger = logging.getLogger(__name__)

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a request whose client left first (nobody reads the answer)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (and has unwound, its
    engine requests aborted) and `APIError(499)` is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = not task.done()  # the client went first (or this route is cancelled itself)
        if left:
            task.cancel()
            # NOTE: a cancelled gather ends with CancelledError as its exception, not as cancelled
            with contextlib.suppress(asyncio.CancelledError):
                await task  # a cancelled Generation aborts its engine requests as it unwinds
        gone.cancel()
    if left:
        logger.info("HTTP: %s %s: the client disconnected; its engine requests were aborted", request.method,
                    request.url.path)
        raise APIError(CLIENT_CLOSED, "The client closed the connection before the answer was ready.")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
