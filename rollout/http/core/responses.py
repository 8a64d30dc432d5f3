"""What every route folder answers with: JSON bodies and Server-Sent Events encoded by msgspec, and
the app's `HttpFront` (the routes of `openai/`, `sglang/` and `vllm/` share these)."""

from __future__ import annotations

from typing import Any, Optional

import msgspec
from fastapi import Request, Response

from rollout.http.core.front import HttpFront


def json_response(body: Any, status: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def sse(chunk: Any) -> bytes:
    """One Server-Sent Event: `data: {chunk}`."""
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def front_of(request: Request) -> HttpFront:
    return request.app.state.front
