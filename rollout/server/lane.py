"""EngineLane: the server's calls into its engine, made in arrival order on one worker thread.

The server's socket thread must never block: an engine call waits for the engine loop's next
round (a step), and some wait much longer (a WAIT pause until in-flight requests finish, a weight
update reading files). So the socket thread queues each call here, and the lane makes them one
after another, posting each outcome back through the server's mailbox (`Submitted`, `Done`).

* Generates that queued up meanwhile go to the engine in one `submit_each` (one loop round for
  all, each accepted or refused on its own).
* Order is kept: an Abort queued after a Generate finds the Generate's stream in its record.
* A WAIT pause changes the state in order, then waits for the drain on a helper thread, so calls
  queued behind it (an abort, a continue) are not stuck behind the wait. Weight updates and group
  joins (`weight_sync.WeightReceiver`, which refuses a second one meanwhile) run on helper threads
  the same way: a transfer waits on its sender, and generation goes on until the commit.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from inference import DynamicInferenceEngine, EngineStateError, PauseMode, SamplingParams, SuspendPolicy, UpdatePolicy
from rollout.service.registry import Record
from rollout.wire.messages import (
    Abort,
    Continue,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    Pause,
    RequestMessage,
    ResetPrefixCache,
    Resume,
    SafetensorsDir,
    Stats,
    Suspend,
    UpdateWeights,
)
from weight_sync import DistributedSource, SharedMemorySource, WeightReceiver
from weight_sync.transports.distributed import GroupError, RefusedError

logger = logging.getLogger(__name__)

MAX_BATCH = 1024  # generates handed to the engine in one command


@dataclass(slots=True)
class Submitted:
    """A Generate reached the engine (`error` None) or was refused by it."""

    record: Record
    error: Optional[BaseException] = None


@dataclass(slots=True)
class Done:
    """A control request finished: `value` is what its engine call returned, or `error`; `peer`
    None for the server's own requests (a lease's abort), which nobody is waiting for."""

    peer: Optional[bytes]
    msg: RequestMessage
    value: Any = None
    error: Optional[BaseException] = None


@dataclass(slots=True)
class _Generate:
    record: Record
    prompt: list[int]
    params: SamplingParams
    stream_tokens: bool
    callback: Callable[[Any], None]


@dataclass(slots=True)
class _Control:
    peer: Optional[bytes]
    msg: RequestMessage
    targets: list[Record]  # an Abort's records (the lane reads their streams)


_STOP = object()


class EngineLane:
    """One worker thread in front of `engine` (see module docstring); `post` takes outcomes.

    Invariant: items run in the order they were queued; each Generate queued is posted back
    exactly once as `Submitted`, each control request exactly once as `Done` (also at `stop`).
    """

    def __init__(self, engine: DynamicInferenceEngine, post: Callable[[Any], None], *,
                 drain_timeout: Optional[float] = None, receiver: Optional[WeightReceiver] = None) -> None:
        self.engine = engine
        self.receiver = receiver if receiver is not None else WeightReceiver(engine)
        self._post = post
        self.drain_timeout = drain_timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-lane", daemon=True)
        self._thread.start()

    def generate(self, record: Record, prompt: list[int], params: SamplingParams,
                 callback: Callable[[Any], None]) -> None:
        self._queue.put(_Generate(record, prompt, params, record.request.stream_tokens, callback))

    def control(self, peer: Optional[bytes], msg: RequestMessage, targets: Optional[list[Record]] = None) -> None:
        self._queue.put(_Control(peer, msg, targets or []))

    def depth(self) -> int:
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # ---- the lane thread -----------------------------------------------------------------------

    def _run(self) -> None:
        pending: Optional[Any] = None
        while True:
            item = pending if pending is not None else self._queue.get()
            pending = None
            if item is _STOP:
                return
            if isinstance(item, _Control):
                self._run_control(item)
                continue
            batch = [item]
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(nxt, _Generate):
                    pending = nxt
                    break
                batch.append(nxt)
            self._submit(batch)

    def _submit(self, batch: list[_Generate]) -> None:
        try:
            results = self.engine.submit_each([g.prompt for g in batch], [g.params for g in batch],
                                              stream_tokens=[g.stream_tokens for g in batch],
                                              callbacks=[g.callback for g in batch])
        except Exception as exc:  # noqa: BLE001 (e.g. the loop stopped: every request is refused)
            results = [exc] * len(batch)
        for g, result in zip(batch, results):
            if isinstance(result, Exception):
                self._post(Submitted(g.record, result))
            else:
                g.record.stream = result
                self._post(Submitted(g.record))

    def _run_control(self, item: _Control) -> None:
        try:
            value = self._call(item)
        except Exception as exc:  # noqa: BLE001 (the requester gets it as an ErrorReply)
            self._post(Done(item.peer, item.msg, error=exc))
            return
        if isinstance(value, _Deferred):
            threading.Thread(target=self._finish_deferred, args=(item, value), daemon=True,
                             name="engine-lane-wait").start()
        else:
            self._post(Done(item.peer, item.msg, value))

    def _finish_deferred(self, item: _Control, deferred: _Deferred) -> None:
        try:
            self._post(Done(item.peer, item.msg, deferred.wait()))
        except Exception as exc:  # noqa: BLE001
            self._post(Done(item.peer, item.msg, error=exc))

    def _call(self, item: _Control) -> Any:
        """The engine call a control request stands for; its return value goes into the reply."""
        engine, msg = self.engine, item.msg
        if isinstance(msg, Abort):
            ids = [rid for r in item.targets if r.stream is not None for rid in r.stream.request_ids]
            return {"aborted": engine.abort_many(ids)}
        if isinstance(msg, Pause):
            mode = PauseMode(msg.mode.value)
            if mode is PauseMode.WAIT:
                engine.pause(mode, wait=False)
                return _Deferred(lambda: engine.wait_drained(self.drain_timeout))
            engine.pause(mode)
            return None
        if isinstance(msg, Continue):
            return engine.continue_()
        if isinstance(msg, Suspend):
            report = engine.suspend(SuspendPolicy(msg.policy.value), offload_weights=msg.offload_weights)
            return dataclasses.asdict(report)
        if isinstance(msg, Resume):
            return engine.resume()
        if isinstance(msg, UpdateWeights):
            return _Deferred(lambda: self._update(msg))
        if isinstance(msg, InitWeightsUpdateGroup):
            return _Deferred(lambda: _weight_sync_errors(lambda: {"rank": self.receiver.init_group(
                msg.master_address, msg.master_port, msg.rank_offset, msg.world_size, msg.group_name, msg.backend,
                msg.timeout_s)}))
        if isinstance(msg, DestroyWeightsUpdateGroup):
            return {"destroyed": int(self.receiver.destroy_group(msg.group_name))}
        if isinstance(msg, ResetPrefixCache):
            return engine.reset_prefix_cache()
        if isinstance(msg, Stats):
            stats = engine.stats()
            stats["kv_utilization"] = engine.kv_utilization()
            return stats
        raise TypeError(f"the engine lane has no call for {type(msg).__name__}")

    def _update(self, msg: UpdateWeights) -> Any:
        """A weight update through the receiver; the reply's `stats` say whether it committed."""
        policy = None if msg.policy is None else UpdatePolicy(msg.policy.value)
        receiver, source, version = self.receiver, msg.source, msg.target_version
        if isinstance(source, SafetensorsDir):
            try:
                committed = receiver.update_from_disk(source.path, version=version, policy=policy)
            except (OSError, KeyError) as exc:  # NOTE: the request's fault (a path, a name), not the server's
                raise ValueError(f"source.path {source.path!r}: {type(exc).__name__}: {exc}") from exc
        elif isinstance(source, DistributedSource):
            committed = _weight_sync_errors(lambda: receiver.update_from_distributed(source, version=version,
                                                                                     policy=policy))
        elif isinstance(source, SharedMemorySource):
            committed = _weight_sync_errors(lambda: receiver.update_from_shared_memory(source, version=version,
                                                                                       policy=policy))
        else:
            raise TypeError(f"no weight source {type(source).__name__}")
        return {"committed": int(committed is not None), "bytes_received": receiver.stats.bytes_received}


@dataclass(slots=True)
class _Deferred:
    """A result that needs a long wait after the call itself (a WAIT pause's drain)."""

    wait: Callable[[], Any]


def _weight_sync_errors(call: Callable[[], Any]) -> Any:
    """The receiver's failures as the wire's codes: a refused manifest or a bad bucket is the
    request's fault (INVALID_REQUEST); a dead sender or a broken group leaves the engine unable to
    complete it (ENGINE_STATE), never the server's bug."""
    try:
        return call()
    except KeyError as exc:  # NOTE: WeightNameError: a manifest for another model
        raise ValueError(str(exc)) from exc
    except (GroupError, RefusedError, TimeoutError) as exc:
        raise EngineStateError(f"weight update aborted: {exc}") from exc
