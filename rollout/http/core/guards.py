"""RequestGuard: what every HTTP request must show before a route sees it.

The front is unauthenticated on loopback, so a web page in the user's browser is the attacker to
keep out. A browser can send two kinds of request to it on its own:

* a "simple" cross-site request (a form, `fetch(..., {mode: "no-cors"})`, an `<img>`): any
  method but only `text/plain`, form or no content type, no preflight. So a request that changes
  state (every method but GET / HEAD / OPTIONS, and the SGLang routes that take GET for a control
  call) and carries a body must carry it as `Content-Type: application/json`, which a page can only
  send after a CORS preflight this server never grants: else 415. One without a body or a content
  type is what SGLang's own tools send (`requests.post(url + "/flush_cache")`), so it passes,
  unless it shows a browser's marks of another site: `Sec-Fetch-Site: cross-site` / `same-site`
  (every current browser sends it), or an `Origin` whose host is not allowed (sent with every
  fetch that is not a GET): 403. NOTE: what is left is a GET of one of SGLang's three GET control
  routes from a browser too old to send `Sec-Fetch-Site` (it can flush the cache or release
  memory; loading weights needs a JSON body); `--api-key` closes that too.
* a DNS-rebinding request: a page whose name now resolves to 127.0.0.1, same-origin to the
  browser, so no preflight; but its `Host` header is the page's name. A `Host` must be an IP
  literal (no name to rebind), `localhost` (when serving on loopback or on every address), the
  address served on, or a name allowed with `--allowed-host` (`*`: any); else 400.

It also bounds a request body (`max_body_bytes`: 413, from `Content-Length` before anything is
read, or as a chunked body grows), so no client makes the front buffer more than that per request.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Iterable
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from rollout.http.core.errors import APIError, error_response
from rollout.wire.security import is_loopback

logger = logging.getLogger(__name__)

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ANY_HOST = "*"


def host_name(header: str) -> str:
    """The name or address of a `Host` header, without its port, brackets or trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal: [::1]:8000
        return header[1:header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.rstrip(".")


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def allowed_host_names(bound_host: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names (besides IP literals) a `Host` header may carry for a server bound to `bound_host`."""
    names = {host_name(bound_host)} | {host_name(h) if h != ANY_HOST else ANY_HOST for h in extra}
    wildcard = is_ip_literal(host_name(bound_host)) and ipaddress.ip_address(host_name(bound_host)).is_unspecified
    if is_loopback(bound_host.strip("[]")) or wildcard:
        names.add("localhost")
    return frozenset(names)


class RequestGuard:
    """ASGI middleware (see module docstring). `state_changing_gets`: paths whose GET changes
    state (SGLang's `/flush_cache`, memory occupation), held to the POST rule."""

    def __init__(self, app: Any, *, allowed_hosts: frozenset[str], max_body_bytes: int,
                 state_changing_gets: frozenset[str] = frozenset()) -> None:
        self.app, self.allowed_hosts, self.max_body_bytes = app, allowed_hosts, max_body_bytes
        self.state_changing_gets = state_changing_gets

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self._refusal(request)
        if refusal is not None:
            logger.info("HTTP: %s %s from %s refused: %s", request.method, request.url.path, scope.get("client"),
                        refusal.message)
            # NOTE: a body too large is left unread: the connection closes rather than drain it
            close = {"Connection": "close"} if refusal.status == 413 else None
            await error_response(request, refusal, headers=close)(scope, receive, send)
            return
        await self.app(scope, self._bounded(receive), send)

    def _refusal(self, request: Request) -> APIError | None:
        host = request.headers.get("host")
        if host is not None and not self._host_allowed(host_name(host)):
            return APIError(400, f"Host `{host}` is not served here (a guard against DNS rebinding); a server "
                            f"reached by that name must be started with `--allowed-host {host_name(host)}`.",
                            code="invalid_host")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        if not self._changes_state(request):
            return None
        site, origin = request.headers.get("sec-fetch-site"), request.headers.get("origin")
        if site in ("cross-site", "same-site") or (origin is not None and not self._origin_allowed(origin)):
            return APIError(403, f"{request.method} {request.url.path} changes the server's state; a page of "
                            f"another site may not call it (Origin {origin!r}, Sec-Fetch-Site {site!r}).",
                            code="cross_site_request")
        content_type = request.headers.get("content-type")
        # NOTE: what a page can send cross-site without a preflight is refused even empty (a form to
        # /pause has no body); an empty call with another type (aiohttp's octet-stream) is no such risk
        if (_is_simple(content_type) or _has_body(request)) and not _is_json(content_type or ""):
            return APIError(415, f"{request.method} {request.url.path} changes the server's state, so a body must be "
                            "sent with `Content-Type: application/json` (an empty call may send `{}`, or nothing).",
                            code="unsupported_media_type")
        return None

    def _origin_allowed(self, origin: str) -> bool:
        """An `Origin` (scheme://host[:port], or "null" from a sandboxed page) names an allowed host."""
        _, sep, rest = origin.partition("://")
        return bool(sep) and self._host_allowed(host_name(rest.split("/", 1)[0]))

    def _host_allowed(self, name: str) -> bool:
        return ANY_HOST in self.allowed_hosts or name in self.allowed_hosts or is_ip_literal(name)

    def _changes_state(self, request: Request) -> bool:
        return request.method not in READ_METHODS or (request.method == "GET"
                                                      and request.url.path in self.state_changing_gets)

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body exceeds {self.max_body_bytes} bytes (the server's "
                        "--http-max-body-bytes).", code="request_too_large")

    def _bounded(self, receive: Any) -> Any:
        """`receive` that refuses (413) a body growing past the bound, before it is all buffered."""
        seen = 0

        async def bounded() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    # NOTE: FastAPI re-raises an HTTPException from reading the body; the app's handler answers it
                    raise HTTPException(413, self._too_large().message, headers={"Connection": "close"})
            return message

        return bounded


class BearerKey:
    """ASGI middleware: every request must send `Authorization: Bearer KEY` (401 otherwise).

    NOTE: plain ASGI, not Starlette's BaseHTTPMiddleware, which fails a request whose client leaves
    before the answer ("No response returned") instead of letting the route see it gone."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self._expected):
                refusal = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
                await error_response(request, refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ClosedRoutes:
    """ASGI middleware: `paths` answer 404 as routes this server lacks (FastAPI's own body), whatever
    the method, before any other check (a closed route reads no body)."""

    def __init__(self, app: Any, paths: Iterable[str]) -> None:
        self.app, self._closed = app, frozenset(paths)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") in self._closed:
            await JSONResponse({"detail": "Not Found"}, status_code=404)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return (length is not None and length.strip() not in ("", "0")) or "transfer-encoding" in request.headers


SIMPLE_MEDIA = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")  # CORS-safelisted


def _is_simple(content_type: Optional[str]) -> bool:
    """A type a browser sends cross-site without a preflight (a form's, a text body's)."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() in SIMPLE_MEDIA


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
