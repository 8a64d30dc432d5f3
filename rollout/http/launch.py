"""`start_front`: an HTTP front on a thread, connected to a rollout service at `address`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rollout.client.aio import AsyncRolloutClient
from rollout.http.app import HttpServer, build_app
from rollout.http.front import FrontConfig, HttpFront
from rollout.text import TextCodec
from rollout.wire.security import ClientSecurity


class RunningFront:
    """A started front: `url`, `front`; `stop()` ends the server and closes its client."""

    def __init__(self, server: HttpServer, front: HttpFront) -> None:
        self.server, self.front = server, front

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        self.front.client.connection.close()


def model_context(model_dir: Path) -> int:
    """The model's own context length (config.json's max_position_embeddings), else 4096."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 4096))
    except (OSError, ValueError):
        return 4096


def start_front(address: str, model_dir: Path, *, host: str = "127.0.0.1", port: int = 0,
                served_model_name: Optional[str] = None, max_model_len: Optional[int] = None,
                api_key: Optional[str] = None, token: Optional[str] = None, timeout: float = 600.0,
                tokenizer: Any = None) -> RunningFront:
    """Serve HTTP on `host:port` in front of the rollout service at `address` (a server or router)."""
    codec = TextCodec.load(tokenizer if tokenizer is not None else model_dir)
    config = FrontConfig(model_name=served_model_name or Path(model_dir).name,
                         max_model_len=max_model_len or model_context(model_dir), model_path=str(model_dir),
                         timeout=timeout, api_key=api_key)
    client = AsyncRolloutClient(address, timeout=timeout,
                                security=ClientSecurity(token=token) if token else None)
    front = HttpFront(client, codec, config)
    try:
        server = HttpServer(build_app(front), host, port, api_key=api_key).start()
    except BaseException:
        client.connection.close()
        raise
    return RunningFront(server, front)
