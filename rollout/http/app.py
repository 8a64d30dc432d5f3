"""The ASGI app (FastAPI) of the HTTP front, and `HttpServer`, which runs it with uvicorn.

    front = HttpFront(ServiceClient(address), TextCodec.load(model_dir), FrontConfig("smollm2", 4096))
    server = HttpServer(build_app(front), host="127.0.0.1", port=0).start()   # server.url

The server binds its socket before uvicorn starts (port 0: one the OS chooses, in `url`) and
refuses an address beyond loopback without an API key (clients then send
`Authorization: Bearer KEY`, as OpenAI's client does). It runs on a thread of its own with its
own event loop, so it can share a process with an engine (`rollout serve --http`).

What a client may hold of it is bounded twice: per connection (`rollout.http.core.connections`: header
and body read timeouts, head size, open connections) and per request (`rollout.http.core.guards`: the
`Host` it names, a JSON content type on calls that change state, the body size).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable
from typing import Optional

from fastapi import FastAPI

from rollout.http.core import errors
from rollout.http.core.connections import KEEP_ALIVE_S, ConnectionLimits, protocol_class
from rollout.http.core.front import HttpFront
from rollout.http.core.guards import ANY_HOST, BearerKey, ClosedRoutes, RequestGuard, allowed_host_names
from rollout.http.core.metrics_routes import router as metrics_router
from rollout.http.openai.openai_routes import router as openai_router
from rollout.http.sglang.sglang_routes import STATE_CHANGING_GETS
from rollout.http.sglang.sglang_routes import router as sglang_router
from rollout.http.vllm.lora_routes import router as lora_router
from rollout.http.vllm.tokenize_routes import router as tokenize_router
from rollout.http.vllm.vllm_routes import router as vllm_router
from rollout.http.vllm.vllm_weight_routes import router as vllm_weight_router
from rollout.wire.security import is_loopback

logger = logging.getLogger(__name__)


def build_app(front: HttpFront) -> FastAPI:
    app = FastAPI(title="rollout-engine", docs_url=None, redoc_url=None)
    app.state.front = front
    errors.install(app)
    if front.config.api_key:
        app.add_middleware(BearerKey, key=front.config.api_key)
    app.include_router(tokenize_router)
    app.include_router(openai_router)
    app.include_router(sglang_router)
    app.include_router(vllm_router)
    app.include_router(metrics_router)
    app.include_router(vllm_weight_router)
    app.include_router(lora_router)
    if front.config.closed_routes:
        app.add_middleware(ClosedRoutes, paths=front.config.closed_routes)
    return app


class HttpServer:
    """uvicorn serving `app` on `host:port` from a background thread (see module docstring);
    `allowed_hosts`: names besides the bound address a client's `Host` may carry (`*`: any)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, api_key: Optional[str] = None,
                 limits: Optional[ConnectionLimits] = None, allowed_hosts: Iterable[str] = (),
                 log_level: str = "warning") -> None:
        import uvicorn

        if not is_loopback(host) and not api_key:
            raise ValueError(f"HTTP on {host} (beyond loopback) needs an API key (--api-key)")
        self.limits = limits or ConnectionLimits()
        # NOTE: with a key, a rebinding or cross-site page cannot authenticate, so any Host may reach
        # the front (a cluster's service names); without one (loopback only) the names are checked
        names = frozenset({ANY_HOST}) if api_key else allowed_host_names(host, allowed_hosts)
        guarded = RequestGuard(app, allowed_hosts=names,
                               max_body_bytes=self.limits.max_body_bytes, state_changing_gets=STATE_CHANGING_GETS)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        # NOTE: httptools, not h11: h11's replies stalled keep-alive clients ~40 ms (Nagle / delayed ACK);
        # its protocol subclassed for the read timeouts and connection bound uvicorn lacks
        config = uvicorn.Config(guarded, log_level=log_level, access_log=False, lifespan="off",
                                http=protocol_class(self.limits), loop="auto", timeout_graceful_shutdown=5,
                                timeout_keep_alive=KEEP_ALIVE_S)
        self._server = uvicorn.Server(config)
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> HttpServer:
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="rollout-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._socket.close()
