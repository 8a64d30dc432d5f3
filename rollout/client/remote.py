"""RemoteClient: what both ZMQ clients share (`RolloutClient`, blocking; `AsyncRolloutClient`).

One connection (`rollout.client.connection`: its I/O thread owns the socket, heartbeats the lease,
reconnects and resubmits), the tokenizer that encodes text prompts on the client, the Generates of
a `stream` call, and the control calls (`rollout.control`, with SGLang's weight-call names). What
each adds is how its caller waits: its stream class, `generate`, `_control`, and closing.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from inference import SamplingParams
from rollout.backend import Prompts
from rollout.client.connection import Connection
from rollout.client.streams import build_generates
from rollout.client.weights import WeightSyncCalls
from rollout.text import TextCodec, token_prompts
from rollout.wire.security import ClientSecurity


class RemoteClient(WeightSyncCalls):
    """A rollout service at `address` (a server or a router).

    `lease_s`: how long the server waits after this client falls silent before it aborts its
    requests (heartbeats every `lease_s / 4`, at most 10 s, keep it alive; a service may cut a
    lease to its own `max_lease_s`). `timeout`: the default bound of every call. `security`: the
    server's token or CURVE keys (`rollout.wire.security.ClientSecurity`). `tokenizer` (a model
    directory, an HF tokenizer or a `TextCodec`): text and chat prompts are encoded here, on the
    client, and every `Rollout` carries its decoded `text`.
    """

    stream_class: ClassVar[type]  # the client's sample stream: `(client, prompts, generates, n, timeout)`

    def __init__(self, address: str, *, timeout: float = 300.0, lease_s: float = 10.0,
                 security: Optional[ClientSecurity] = None, reconnect_after_s: Optional[float] = None,
                 tokenizer: Any = None, **connection_options: Any) -> None:
        self.timeout = timeout
        self.codec: Optional[TextCodec] = None if tokenizer is None else TextCodec.load(tokenizer)
        self.connection = Connection(address, security=security, lease_s=lease_s,
                                     reconnect_after_s=reconnect_after_s, **connection_options)

    def stream(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
               tokens: bool = False, timeout: Optional[float] = None, session_id: Optional[str] = None,
               group_id: Optional[str] = None) -> Any:
        """The samples of `generate(prompts, n, sampling)`, each as it finishes (its tokens as they
        come if `tokens`): one Generate per prompt, sent now. Behind a router, `session_id` keeps a
        multi-turn agent's turns on one replica and `group_id` the prompts of this call (and of later
        calls with it); a server ignores both."""
        prompts = token_prompts(prompts, self.codec)
        requests = build_generates(self.connection, prompts, n, sampling, tokens, session_id, group_id)
        return self.stream_class(self, prompts, requests, n, self.timeout if timeout is None else timeout)

    def abort(self, stream: Any) -> Any:
        """Finish a stream's running samples now (see `rollout.backend.SampleStream.abort`)."""
        return stream.abort()

    def _next_id(self, prefix: str = "c") -> str:
        return self.connection.next_id(prefix)

    def reconnect(self) -> None:
        """Replace the socket now; unanswered requests are resubmitted (answered exactly once)."""
        self.connection.reconnect()
