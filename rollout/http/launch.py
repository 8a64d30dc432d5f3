"""Start an HTTP front on a thread: `start_front` in front of a rollout service at an address (over
ZMQ), `serve_front` on a client the caller built (e.g. the in-process one of `rollout serve --http`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from rollout.http.app import HttpServer, build_app
from rollout.http.core.clients import FrontClient, ServiceClient
from rollout.http.core.connections import ConnectionLimits
from rollout.http.core.front import FrontConfig, HttpFront
from rollout.http.core.schemas import MAX_TOP_LOGPROBS
from rollout.text import TextCodec, TokenOnlyCodec
from rollout.wire.security import ClientSecurity


class RunningFront:
    """A started front: `url`, `front`; `stop()` ends the server, then runs `on_stop` (closing the
    client the front owns)."""

    def __init__(self, server: HttpServer, front: HttpFront, on_stop: Optional[Callable[[], None]] = None) -> None:
        self.server, self.front, self._on_stop = server, front, on_stop

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        if self._on_stop is not None:
            self._on_stop()


def model_context(model_dir: Path) -> int:
    """The model's own context length (config.json's max_position_embeddings), else 4096."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 4096))
    except (OSError, ValueError):
        return 4096


def chat_template_text(value: str) -> str:
    """vLLM's `--chat-template` value: a file's path (its text), or the template itself."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # NOTE: a template too long to be a file name
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r}: no such file, and not a Jinja template either")


def serve_front(client: FrontClient, model_dir: Path, *, host: str = "127.0.0.1", port: int = 0,
                served_model_name: Union[str, Sequence[str], None] = None, max_model_len: Optional[int] = None,
                api_key: Optional[str] = None, timeout: float = 600.0, tokenizer: Any = None,
                limits: Optional[ConnectionLimits] = None, allowed_hosts: Iterable[str] = (),
                on_stop: Optional[Callable[[], None]] = None, tool_call_parser: str = "none",
                skip_tokenizer_init: bool = False, sampling_defaults: Optional[dict[str, float]] = None,
                return_tokens_as_token_ids: bool = False, chat_template: Optional[str] = None,
                max_logprobs: int = MAX_TOP_LOGPROBS, logprobs_mode: str = "raw",
                closed_routes: Iterable[str] = (), loras: Optional[dict[str, str]] = None) -> RunningFront:
    """Serve HTTP on `host:port` over `client`; `on_stop` runs after the server stops (and if it
    fails to start). `served_model_name`: one name or several (the first reported; default the
    directory's name). `limits`, `allowed_hosts`: see `rollout.http.app.HttpServer`;
    `tool_call_parser`: see `rollout.http.core.tools`; `skip_tokenizer_init`: token ids in and out only
    (`rollout.text.TokenOnlyCodec`), for a model directory without a tokenizer, as vLLM's flag;
    `sampling_defaults`: values for sampling fields an OpenAI request leaves unset
    (`rollout.http.core.sampling.generation_defaults`); `return_tokens_as_token_ids`: the default of that
    request field (vLLM's flag); `chat_template`: the template that replaces the tokenizer's (its text,
    or a file holding it: `chat_template_text`); `max_logprobs`, `logprobs_mode`, `closed_routes`:
    see `FrontConfig`; `loras`: the adapters the engine already holds (name -> path), servable at once."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    try:
        if skip_tokenizer_init and tokenizer is not None:
            raise ValueError("skip_tokenizer_init and a tokenizer cannot both be given")
        codec = TokenOnlyCodec.from_config(model_dir) if skip_tokenizer_init \
            else TextCodec.load(tokenizer if tokenizer is not None else model_dir)
        if chat_template is not None:
            if not codec.has_text:
                raise ValueError("a chat template needs a tokenizer (not with skip_tokenizer_init)")
            codec.tokenizer.chat_template = chat_template_text(chat_template)
        config = FrontConfig(model_name=names[0] if names else Path(model_dir).name, aliases=tuple(names[1:]),
                             max_model_len=max_model_len or model_context(model_dir), model_path=str(model_dir),
                             timeout=timeout, api_key=api_key, tool_parser=tool_call_parser,
                             sampling_defaults=tuple(sorted((sampling_defaults or {}).items())),
                             return_tokens_as_token_ids=return_tokens_as_token_ids, max_logprobs=max_logprobs,
                             logprobs_mode=logprobs_mode, closed_routes=tuple(closed_routes))
        front = HttpFront(client, codec, config, loras=loras)
        server = HttpServer(build_app(front), host, port, api_key=api_key, limits=limits,
                            allowed_hosts=allowed_hosts).start()
    except BaseException:
        if on_stop is not None:
            on_stop()
        raise
    return RunningFront(server, front, on_stop)


def start_front(address: str, model_dir: Path, *, host: str = "127.0.0.1", port: int = 0,
                served_model_name: Union[str, Sequence[str], None] = None, max_model_len: Optional[int] = None,
                api_key: Optional[str] = None, token: Optional[str] = None, timeout: float = 600.0,
                tokenizer: Any = None, limits: Optional[ConnectionLimits] = None,
                allowed_hosts: Iterable[str] = (), tool_call_parser: str = "none",
                skip_tokenizer_init: bool = False) -> RunningFront:
    """Serve HTTP on `host:port` in front of the rollout service at `address` (a server or router)."""
    client = ServiceClient(address, timeout=timeout, security=ClientSecurity(token=token) if token else None)
    return serve_front(client, model_dir, host=host, port=port, served_model_name=served_model_name,
                       max_model_len=max_model_len, api_key=api_key, timeout=timeout, tokenizer=tokenizer,
                       limits=limits, allowed_hosts=allowed_hosts, on_stop=client.connection.close,
                       tool_call_parser=tool_call_parser, skip_tokenizer_init=skip_tokenizer_init)
