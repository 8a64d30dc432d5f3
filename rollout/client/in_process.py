"""InProcessClient: `AsyncRolloutClient`'s calls on an engine in this process, with no socket between.

    client = InProcessClient(engine)                   # its own weight receiver; starts the loop if none runs
    client = InProcessClient(server.engine, server.receiver,
                             health_deadline_s=server.config.health_deadline_s)   # beside a RolloutServer
    async for item in client.stream(prompts, tokens=True):
        ...

What `rollout serve --http` runs its HTTP front on (`rollout.http.core.clients.FrontClient`). Every call
is what a `RolloutServer` would do with the same request (`rollout.server.dispatch`): an engine call
posted to the engine's loop (`engine.post`, `engine.when`: its one command queue, in order with the
server's), a weight call handed to the weight receiver's worker. The event loop awaits their
futures (`asyncio.wrap_future`) and stream callbacks reach it by `call_soon_threadsafe`, so it
never waits on a step; nothing is encoded and no thread but the engine's loop is crossed.

The answers equal the ZMQ path's: a finished sample goes through the wire's converters (the
`SampleOutput` a server would send, then the client's `Rollout`), token chunks carry float32
log-probs, an error becomes the `ErrorReply` a server would send and the exception a client makes
of it (so an HTTP front maps it to the same status), health follows the server's rule, and stats
have the server's keys: the engine's figures (`engine/*`, the headline keys), `weight_sync/*`, and
counters of this client's own traffic (a server counts its socket's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Optional, Union

import numpy as np

from inference import DynamicInferenceEngine, PendingAdmission, SamplingParams
from inference.request import RequestOutput, TokenEvent
from rollout.backend import Prompts, params_per_prompt, sort_rollouts
from rollout.client.aio import AsyncClient
from rollout.client.streams import with_prompt_logprobs
from rollout.collector import SampleCollector
from rollout.control import Read
from rollout.service.engine_service import HEALTH_DEADLINE_S, EngineService
from rollout.service.metrics import ServiceMetrics, _wire_values
from rollout.text import TextCodec, add_text, token_prompts
from rollout.types import Rollout, TokenChunk
from rollout.wire import messages as wire
from rollout.wire.codec import ProtocolError
from rollout.wire.convert import error_from_reply, error_reply, output_from_wire, output_to_wire
from rollout.wire.kinds import ErrorCode
from weight_sync import Staging, WeightReceiver


class InProcessStream:
    """The samples of one `InProcessClient.stream` call (see `rollout.backend.SampleStream`), as an
    async iterator; past its deadline the running samples are aborted.

    Invariant: each prompt's `n` samples are yielded once each (tokens of a finished sample are
    dropped); a refused prompt raises its error and aborts the rest.
    """

    def __init__(self, client: InProcessClient, prompts: Prompts, params: list[SamplingParams], tokens: bool,
                 timeout: float) -> None:
        self._client, self._codec = client, client.codec
        self._prompts = [list(map(int, p)) for p in prompts]
        self._n = [p.n for p in params]
        self.collector = SampleCollector([client.next_id() for _ in self._prompts], self._n, timeout)
        self.request_ids = self.collector.request_ids
        self._items: deque[tuple[int, Any]] = deque()
        self._ready = asyncio.Event()
        loop = asyncio.get_running_loop()

        def sink(group: int) -> Callable[[Any], None]:  # NOTE: called on the engine's loop thread
            return lambda item: _call_in(loop, self._push, group, item)

        engine = client.engine
        # NOTE: each call is its own client of the engine's admission (taking turns with the others),
        # so one call's many samples do not hold a later small call behind all of them
        clients = self.request_ids[:1] * len(self._prompts)
        self._submitted = engine.post(lambda: engine.submit_each(
            self._prompts, params, stream_tokens=tokens, callbacks=[sink(g) for g in range(len(self._prompts))],
            clients=clients, defer_compiles=True))  # NOTE: a new grammar is built off the loop
        self._submitted.add_done_callback(lambda f: _call_in(loop, self._refusals, f))
        client.streams.add(self)
        client.metrics.count("requests_run", len(self._prompts))

    # ---- the event loop's side of the engine's callbacks ----------------------------------------

    def _push(self, group: int, item: Any) -> None:
        if isinstance(item, RequestOutput):  # NOTE: the server's reply, then the client's Rollout of it
            sample = output_to_wire(item, self.request_ids[group], n=self._n[group])
            self._client.metrics.sample_sent(sample.versions)
            item = with_prompt_logprobs(output_from_wire(sample, self._prompts[group], group), sample)
        elif isinstance(item, BaseException):  # NOTE: a deferred admission's refusal, as a server words it
            item = self._client.as_reply_error(item)
        self._items.append((group, item))
        self._ready.set()

    def _refusals(self, submitted: concurrent.futures.Future) -> None:
        error = submitted.exception()
        results = [error] * len(self._prompts) if error is not None else submitted.result()
        for group, result in enumerate(results):
            if isinstance(result, BaseException):
                self._push(group, self._client.as_reply_error(result))

    # ---- the reader's side ----------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Union[Rollout, TokenChunk]]:
        return self

    async def __anext__(self) -> Union[Rollout, TokenChunk]:
        while not self.collector.done:
            while not self._items:
                self._ready.clear()
                try:
                    await asyncio.wait_for(self._ready.wait(), self.collector.wait_s())
                except asyncio.TimeoutError:
                    raise self._timed_out() from None
            item = self._accept(*self._items.popleft())
            if item is not None:
                return item
        raise StopAsyncIteration

    def _accept(self, group: int, item: Any) -> Optional[Union[Rollout, TokenChunk]]:
        """The item of one queued entry (None: nothing to yield); an error aborts the rest and is raised."""
        collector = self.collector
        if isinstance(item, BaseException):
            collector.refuse(group)
            self._give_up()
            raise item
        if isinstance(item, TokenEvent):
            return self._chunk(group, item)
        if not collector.take(group, item.sample_index):
            return None
        if collector.left(group) == 0:
            self._client.metrics.count("requests_finished")
        if collector.done:
            self._client.streams.discard(self)
        add_text([item], self._codec)
        return item

    def _chunk(self, group: int, first: TokenEvent) -> Optional[TokenChunk]:
        """`first` and the tokens of its sample queued right behind it, as one chunk (a reader that
        lags gets fewer, larger chunks, as a server's mailbox batches them)."""
        if self.collector.taken(group, first.sample_index):
            return None
        events = [first]
        while self._items:
            g, nxt = self._items[0]
            if not (g == group and isinstance(nxt, TokenEvent) and nxt.sample_index == first.sample_index):
                break
            events.append(self._items.popleft()[1])
        logprobs = np.asarray([e.logprob for e in events], dtype=np.float32)  # NOTE: as a TokenDelta carries them
        return TokenChunk(group, first.sample_index, first.index, [int(e.token_id) for e in events],
                          logprobs.tolist(), [int(e.version) for e in events])

    def _timed_out(self) -> TimeoutError:
        self._give_up()
        return TimeoutError(f"stream of {len(self.request_ids)} prompts not done within {self.collector.timeout} s; "
                            "its running samples were aborted")

    async def result(self) -> list[Rollout]:
        return sort_rollouts([item async for item in self if isinstance(item, Rollout)])

    def unfinished(self) -> list[str]:
        return self.collector.unfinished()

    def _abort_call(self, only: Optional[set[str]] = None) -> Callable[[], int]:
        """What aborts the running samples (of the requests `only` names; None: all), run on the loop."""
        groups = [g for g in range(len(self.request_ids))
                  if self.collector.left(g) > 0 and (only is None or self.request_ids[g] in only)]
        submitted, engine = self._submitted, self._client.engine

        def call() -> int:  # NOTE: on the loop, after the submit posted before it
            if not submitted.done() or submitted.exception() is not None:
                return 0
            streams = submitted.result()
            for g in groups:
                if isinstance(streams[g], PendingAdmission):  # NOTE: its grammar still builds: aborted once admitted
                    streams[g].cancel()
            return engine.abort_many([i for g in groups if not isinstance(streams[g], BaseException)
                                      for i in streams[g].request_ids])
        return call

    async def abort(self) -> None:
        pending = self.unfinished()
        if pending:
            await self._client.abort_requests(pending)

    def _give_up(self) -> None:
        """Stop reading: the running samples are aborted (not waited for), the iteration ends."""
        if self.unfinished():
            self._client.engine.post(self._abort_call())
        self.collector.give_up()
        self._client.streams.discard(self)


class InProcessClient(AsyncClient):
    """The asyncio calls of `AsyncRolloutClient` on `engine` in this process (see module docstring):
    its control calls (`rollout.control`, and SGLang's weight-call names over them) answered by the
    engine service.

    `receiver`: the engine's `WeightReceiver` (one per engine: a server's, when one serves the
    same engine); None builds one of its own (`weight_staging`, `weight_sync_timeout_s`), closed
    by `close()`. The engine's loop is started if it is not running (and stopped by `close()`).
    `health_deadline_s`: as `ServerConfig`'s, a loop quiet for longer is unhealthy.
    """

    def __init__(self, engine: DynamicInferenceEngine, receiver: Optional[WeightReceiver] = None, *,
                 timeout: float = 300.0, health_deadline_s: float = HEALTH_DEADLINE_S, tokenizer: Any = None,
                 weight_staging: Staging = Staging.DOUBLE, weight_sync_timeout_s: float = 60.0) -> None:
        self.engine, self.timeout, self.health_deadline_s = engine, timeout, health_deadline_s
        self.codec: Optional[TextCodec] = None if tokenizer is None else TextCodec.load(tokenizer)
        self._owns_loop = not engine.loop_running
        if self._owns_loop:
            engine.start()
        self._owns_receiver = receiver is None
        self.receiver = receiver if receiver is not None else WeightReceiver(
            engine, staging=weight_staging, timeout_s=weight_sync_timeout_s)
        self.service = EngineService(engine, self.receiver, health_deadline_s)
        self.metrics = ServiceMetrics()  # NOTE: written on the event loop's thread only
        self.streams: weakref.WeakSet[InProcessStream] = weakref.WeakSet()
        self._ids = itertools.count()

    def next_id(self) -> str:
        return f"local-{next(self._ids)}"

    # ---- generation -----------------------------------------------------------------------------

    def stream(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
               tokens: bool = False, timeout: Optional[float] = None, session_id: Optional[str] = None,
               group_id: Optional[str] = None) -> InProcessStream:
        """`session_id` / `group_id` are a router's hints; one engine has no use for them."""
        prompts = token_prompts(prompts, self.codec)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
        params = params_per_prompt(len(prompts), n, sampling)
        return InProcessStream(self, prompts, params, tokens, self.timeout if timeout is None else timeout)

    # ---- errors, as a client of a server sees them ----------------------------------------------

    def as_reply_error(self, exc: BaseException) -> Exception:
        """`exc` as a ZMQ client would see it: the server's `ErrorReply` of it, read back."""
        reply = error_reply(exc)
        self.metrics.error(reply.code)
        return error_from_reply(reply)

    async def _settle(self, future: concurrent.futures.Future, what: str, timeout: Optional[float],
                      count: Optional[str] = None) -> Any:
        """The future's value, or its error as a client sees it; past `timeout`, `TimeoutError` (the
        call still runs, as a server's does when its client stops waiting)."""
        timeout = self.timeout if timeout is None else timeout
        waiting = asyncio.wrap_future(future)
        done, _ = await asyncio.wait({waiting}, timeout=timeout)
        if not done:
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # NOTE: retrieved, not logged
            raise TimeoutError(f"{what} got no reply within {timeout} s")
        error = waiting.exception()
        if error is not None:
            raise self.as_reply_error(error) from error
        if count:
            self.metrics.count(count)
        return waiting.result()

    # ---- control (`rollout.control`): the engine service answers, as behind a server ------

    def _next_id(self, prefix: str = "c") -> str:
        return self.next_id()

    def _control(self, msg: wire.RequestMessage, timeout: Optional[float], read: Read) -> Awaitable[Any]:
        return self._reply(msg, timeout, read)

    async def _reply(self, msg: wire.RequestMessage, timeout: Optional[float], read: Read) -> Any:
        """`read` of the `Result` a server would send for `msg` (`rollout.server.dispatch`)."""
        kind = type(msg)
        if kind is wire.Stats:
            figures = await self._settle(self.service.figures(), "Stats", timeout)
            live = sum(len(s.unfinished()) for s in list(self.streams))
            fields = {"stats": _wire_values(self.metrics.snapshot(figures, requests_in_flight=live, clients=1,
                                                                  extra=self.receiver.stats.wire()))}
        elif kind is wire.Abort:
            fields = {"stats": {"aborted": await self._abort(msg.targets, timeout)}}
        else:
            fields = await self._settle(self.service.handle(msg), kind.__name__, timeout, msg.counted_as)
        return read(wire.Result(request_id=msg.request_id, request_kind=wire.kind_of(kind),
                                policy_version=self.engine.policy_version, **fields))

    async def _abort(self, targets: list[str], timeout: Optional[float]) -> int:
        """Abort this client's requests `targets` (as a server aborts its client's); how many samples ran."""
        wanted = set(targets)
        calls = [s._abort_call(wanted) for s in list(self.streams) if wanted.intersection(s.request_ids)]
        if not calls:
            raise self.as_reply_error(ProtocolError(ErrorCode.NOT_FOUND, f"no request with id {targets[0]!r}"))
        return await self._settle(self.engine.post(lambda: sum(call() for call in calls)), "Abort", timeout)

    # ---- life cycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close what this client started (its receiver, the engine's loop); blocks until done."""
        if self._owns_receiver:
            self.receiver.close()
        if self._owns_loop:
            self._owns_loop = False
            self.engine.stop()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    async def __aenter__(self) -> InProcessClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _call_in(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """`fn(*args)` on `loop`'s thread, from any thread; dropped once that loop is closed (nobody
    awaits it any more)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass
