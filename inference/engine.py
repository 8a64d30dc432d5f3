"""DynamicInferenceEngine: the in-process client of one `EngineCore`, safe from any thread.

Every public call is safe from any thread (`inference.calls`):
* without a background loop, a call applies at once under the engine's lock, between steps;
* after `start()`, a background thread steps the core, and calls from other threads become
  commands that the loop applies between steps, each returning through a future (bounded by
  `command_timeout`); `post(fn)` hands one over without waiting; `step()` raises while the
  loop runs; `stop()` ends it cleanly.

Each request's outputs go through exactly one channel, chosen when it is added: `step()`'s
return value for `add_request` (callers who drive `step()` themselves), or the `RequestStream`
that `submit()` returns (tokens as they are sampled, then the final `RequestOutput`).
`generate()` is a thin helper over `submit()`. No caller ever receives another's output.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional, Union

import torch

from inference.calls import CoreCalls
from inference.config import InferenceConfig, PauseMode, SuspendPolicy
from inference.core.engine_core import EngineCore
from inference.core.memory import SuspendReport
from inference.core.states import EngineState
from inference.engine_lora import EngineLoRACalls
from inference.engine_weights import EngineWeightCalls
from inference.errors import EngineStateError
from inference.kv_cache.events import KVEventListener
from inference.request import SHARED_CLIENT, RequestOutput, TokenEvent
from inference.sampling.params import SamplingParams
from inference.streams import Callback, PendingAdmission, RequestStream

logger = logging.getLogger(__name__)

Prompt = Sequence[int]
ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]


class _StepChannel:
    """Outputs of `add_request`ed requests, handed out by the next `step()` call."""

    __slots__ = ("outbox",)

    def __init__(self) -> None:
        self.outbox: list[RequestOutput] = []

    def deliver(self, item: Union[RequestOutput, TokenEvent]) -> None:
        if isinstance(item, RequestOutput):
            self.outbox.append(item)


class DynamicInferenceEngine(EngineWeightCalls, EngineLoRACalls):
    """Serves many requests at once on one model replica, next to its trainer (see module doc).

    Invariants: every request added is, at any time, waiting, in a slot, or finished with its
    output delivered exactly once to the channel it was added with. The parts behind `core` are
    for introspection from the thread that owns the engine, not for concurrent use.
    """

    def __init__(self, model: Any, config: Optional[InferenceConfig] = None, *,
                 command_timeout: float = 300.0) -> None:
        self.config = config or InferenceConfig()
        self._channels: dict[int, Union[_StepChannel, RequestStream]] = {}
        self._step_channel = _StepChannel()
        self.core = EngineCore(model, self.config, self._route_output, self._route_tokens)
        self.calls = CoreCalls(self.core, self._on_step_error, command_timeout=command_timeout)

    @classmethod
    def from_pretrained(
        cls,
        model: Union[str, Path, torch.nn.Module],
        config: Optional[InferenceConfig] = None,
        *,
        share_weights: bool = False,
        expert_parallel: Any = None,
    ) -> DynamicInferenceEngine:
        """Build from an HF model directory or an in-memory transformers `*ForCausalLM`; an MoE
        model with `expert_parallel` (an `inference.models.parallel.ExpertParallel`) keeps only this
        rank's experts (then also call `set_ep_communicator`)."""
        from inference.models.loading import load_from_hf_dir, load_from_hf_model

        config = config or InferenceConfig()
        if isinstance(model, (str, Path)) and config.tokenizer is None and (Path(model) / "tokenizer.json").is_file():
            config = dataclasses.replace(config, tokenizer=str(model))  # structured outputs compile against it
        dtype = None if config.dtype == "auto" else config.dtype  # NOTE: None: the checkpoint's, as vLLM's auto
        if isinstance(model, (str, Path)):
            decoder = load_from_hf_dir(model, dtype=dtype, device=config.device, expert_parallel=expert_parallel)
        else:
            decoder = load_from_hf_model(model, share_weights=share_weights, dtype=dtype, device=config.device,
                                         expert_parallel=expert_parallel)
        if config.dtype == "auto":
            config = dataclasses.replace(config, dtype=decoder.spec.dtype)
        engine = cls(decoder, config)
        report = getattr(decoder, "bind_report", None)
        if share_weights and report is not None:
            params = dict(model.named_parameters(remove_duplicate=False))
            engine.core.weights.adopt_aliases([params[n] for n in report.aliased])
        return engine

    # ---- the parts, for introspection --------------------------------------------------------

    model = property(lambda self: self.core.model)
    context = property(lambda self: self.core.context)
    scheduler = property(lambda self: self.core.scheduler)
    allocator = property(lambda self: self.core.allocator)
    kv_cache = property(lambda self: self.core.kv_cache)
    sampler = property(lambda self: self.core.runner.sampler)
    runner = property(lambda self: self.core.runner)
    caches = property(lambda self: self.core.caches)
    weights = property(lambda self: self.core.weights)

    @property
    def state(self) -> EngineState:
        return self.core.state

    @property
    def policy_version(self) -> int:
        return self.core.policy_version

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    # ---- calls: at once under the lock, or as a command on the loop --------------------------

    def post(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` between steps without waiting for it: a `Future` of its result.

        With the background loop running, `fn` is a command on its one queue (in order with every
        other call, also those of other threads); without it, or from the loop itself, it runs at
        once under the lock. Engine methods called inside `fn` run directly (they are on the loop).
        A server posts every engine call this way, so its socket thread never waits on a step.
        """
        return self.calls.post(fn)

    def when(self, condition: Callable[[], bool]) -> Future:
        """A `Future` resolved once `condition()` holds after a round of the loop (e.g. drained, for
        a WAIT pause); without the loop, whenever a waiting thread steps the engine (`settle`)."""
        return self.calls.when(condition)

    def settle(self, future: Future, timeout: Optional[float] = None) -> Any:
        """`future`'s result (a posted call's), waiting at most `timeout` seconds; without the loop,
        this thread steps the engine while that is what the call waits for (a WAIT pause)."""
        return self.calls.settle(future, timeout)

    def _route_output(self, output: RequestOutput) -> None:
        channel = self._channels.pop(output.request_id, None)
        if channel is None:
            logger.error("request %d finished but has no channel; output dropped", output.request_id)
            return
        channel.deliver(output)

    def _route_tokens(self, events: list[TokenEvent]) -> None:
        for event in events:
            channel = self._channels.get(event.request_id)
            if channel is not None:
                channel.deliver(event)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: Prompt, sampling_params: Optional[SamplingParams] = None
                    ) -> Union[int, list[int]]:
        """Queue a prompt whose outputs `step()` returns; its request id, or one id per sample.

        Bad input raises `ValueError` naming the field; a request that can never fit raises the
        typed permanent error. Either way nothing already in the engine is touched. While the
        background loop runs there is no `step()` to return outputs: use `submit()`.
        """
        if self.calls.loop is not None:
            raise EngineStateError("the background loop is running: add requests with submit()")

        def add() -> list[int]:
            prompt, params = self.core.check_request(prompt_token_ids, sampling_params)
            self.core.check_room(params.n)
            ids = self.core.add_checked(prompt, params)
            for rid in ids:
                self._channels[rid] = self._step_channel
            return ids

        self.core.grammars.precompile([sampling_params])
        ids = self.calls.run(add)
        return ids[0] if len(ids) == 1 else ids

    def submit(self, prompt_token_ids: Prompt, sampling_params: Optional[SamplingParams] = None, *,
               stream_tokens: bool = True, callback: Optional[Callback] = None,
               client: Optional[str] = None) -> RequestStream:
        """Queue a prompt; its n samples' tokens and final outputs arrive on the returned stream.

        `client` names who asks (None: the one lane every caller without a name shares): waiting
        requests are admitted in turns between clients, FIFO within one. More than
        `max_samples_per_request` samples raise `ValueError`; a full waiting queue (past
        `max_waiting_samples`) raises `OverloadedError`, to retry later.
        """
        return self.submit_many([prompt_token_ids], sampling_params, stream_tokens=stream_tokens,
                                callback=callback, client=client)[0]

    def submit_many(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None, *,
                    stream_tokens: bool = False, callback: Optional[Callback] = None,
                    client: Optional[str] = None) -> list[RequestStream]:
        """`submit` for many prompts in one call, one request of all their samples: all are queued,
        or (on an error) none."""
        params_list = self._params_per_prompt(prompts, sampling_params)

        def add_all() -> list[RequestStream]:
            checked = [self.core.check_request(p, sp) for p, sp in zip(prompts, params_list)]
            self.core.check_room(sum(params.n for _, params in checked))
            return [self._add_stream(prompt, params, stream_tokens, callback, client) for prompt, params in checked]

        self.core.grammars.precompile(params_list)
        return self.calls.run(add_all)

    def _add_stream(self, prompt: list[int], params: SamplingParams, stream_tokens: bool,
                    callback: Optional[Callback], client: Optional[str]) -> RequestStream:
        ids = self.core.add_checked(prompt, params, stream_tokens=stream_tokens,
                                    client=SHARED_CLIENT if client is None else client)
        stream = RequestStream(self, ids, callback)
        for rid in ids:
            self._channels[rid] = stream
        return stream

    def submit_each(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None, *,
                    stream_tokens: Union[bool, Sequence[bool]] = False,
                    callbacks: Optional[Sequence[Optional[Callback]]] = None,
                    clients: Optional[Sequence[Optional[str]]] = None,
                    defer_compiles: bool = False) -> list[Union[RequestStream, PendingAdmission, Exception]]:
        """`submit` for many prompts in one command, each its own request, accepted or refused on
        its own: for each prompt its stream, or the exception that refused it (nothing else is
        touched); `clients[i]` names who asks for prompt i (see `submit`).

        A server hands every request that arrived meanwhile to the loop at once: one loop round
        for all of them, where `submit` per request would wait a round (a step) each.

        `defer_compiles` (a caller posting this to the loop, with callbacks): a prompt whose
        grammar is not built yet is never compiled here, on the loop, where every request's step
        would wait on it: it is built on the compile thread (`GrammarCompiler.compile_async`, at
        most a few at once per client) and the prompt's entry is a `PendingAdmission`, admitted
        once it is built.
        """
        params_list = self._params_per_prompt(prompts, sampling_params)
        tokens = [stream_tokens] * len(prompts) if isinstance(stream_tokens, bool) else list(stream_tokens)
        callbacks = [None] * len(prompts) if callbacks is None else list(callbacks)
        clients = [None] * len(prompts) if clients is None else list(clients)
        if not len(tokens) == len(callbacks) == len(clients) == len(prompts):
            raise ValueError(f"submit_each: {len(prompts)} prompts, {len(tokens)} stream_tokens, "
                             f"{len(callbacks)} callbacks, {len(clients)} clients")

        def add_each() -> list[Union[RequestStream, PendingAdmission, Exception]]:
            out: list[Union[RequestStream, PendingAdmission, Exception]] = []
            for prompt, params, stream_tokens_, callback, client in zip(prompts, params_list, tokens, callbacks,
                                                                        clients):
                spec = getattr(params, "structured_outputs", None)
                if defer_compiles and spec is not None and callback is not None and not self.core.grammars.ready(spec):
                    try:
                        built = self.core.grammars.compile_async(spec, SHARED_CLIENT if client is None else client)
                    except Exception as exc:  # noqa: BLE001 (this prompt's refusal: too many compiles of its client)
                        out.append(exc)
                        continue
                    pending = PendingAdmission()
                    args = (pending, prompt, params, stream_tokens_, callback, client)
                    built.add_done_callback(lambda _, args=args: self.post(lambda: self._admit(*args)))
                    out.append(pending)
                    continue
                try:
                    out.append(self._check_and_add(prompt, params, stream_tokens_, callback, client))
                except Exception as exc:  # noqa: BLE001 (this prompt's refusal, returned to its caller)
                    out.append(exc)
            return out

        if not defer_compiles:
            self.core.grammars.precompile(params_list)
        return self.calls.run(add_each)

    def _admit(self, pending: PendingAdmission, prompt: Prompt, params: Optional[SamplingParams],
               stream_tokens: bool, callback: Callback, client: Optional[str]) -> None:
        """On the loop, once a deferred prompt's grammar was built (or refused): checked and queued
        as `submit_each` would have; a refusal goes to its callback."""
        try:
            pending.stream = self._check_and_add(prompt, params, stream_tokens, callback, client)
        except Exception as exc:  # noqa: BLE001 (the prompt's refusal, to whoever waits on it)
            callback(exc)
            return
        if pending.cancelled:  # NOTE: aborted while its grammar was built
            self.abort_many(pending.stream.request_ids)

    def _check_and_add(self, prompt: Prompt, params: Optional[SamplingParams], stream_tokens: bool,
                       callback: Optional[Callback], client: Optional[str]) -> RequestStream:
        """One prompt checked (`check_request`, `check_room`: its refusal raised) and queued."""
        checked_prompt, checked_params = self.core.check_request(prompt, params)
        self.core.check_room(checked_params.n)
        return self._add_stream(checked_prompt, checked_params, stream_tokens, callback, client)

    @staticmethod
    def _params_per_prompt(prompts: Sequence[Prompt], sampling_params: ParamsArg) -> list[Optional[SamplingParams]]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        params_list = list(sampling_params)
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params: {len(params_list)} given for {len(prompts)} prompts")
        return params_list

    def abort(self, request_id: int) -> bool:
        """Finish a request now with reason `abort` (partial tokens kept); False if unknown/done."""
        return self.calls.run(self.core.abort, request_id)

    def abort_many(self, request_ids: Sequence[int]) -> int:
        """Abort several requests in one call; how many were still live."""
        return self.calls.run(lambda: sum(self.core.abort(rid) for rid in request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.calls.run(self.core.has_unfinished_requests)

    def generate(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None, *,
                 use_tqdm: bool = False, timeout: Optional[float] = None) -> list[RequestOutput]:
        """Run `prompts` to completion; outputs in prompt order, the n samples of a prompt together.

        Other callers' requests are untouched. If waiting fails (a timeout, an interrupt, a failed
        step), this call's unfinished requests are aborted before the error propagates.
        """
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=None, desc="generate", unit="req")
        callback = None if bar is None else (lambda item: bar.update(1) if isinstance(item, RequestOutput) else None)
        streams = self.submit_many(prompts, sampling_params, stream_tokens=False, callback=callback)
        if bar is not None:
            bar.total = sum(len(s.request_ids) for s in streams)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            outputs = []
            for stream in streams:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                outputs.extend(stream.result(left))
            return outputs
        except BaseException:
            self.abort_many([rid for s in streams for rid in s.request_ids])
            raise
        finally:
            if bar is not None:
                bar.close()

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of `add_request`ed requests that finished since the
        last call (aborted ones included). Streams get theirs directly."""
        if self.calls.loop is not None:
            raise EngineStateError("the background loop is running; step() is its job (stop() it first)")
        with self.calls.lock:
            self.core.step()
            outbox, self._step_channel.outbox = self._step_channel.outbox, []
            return outbox

    def set_ep_communicator(self, communicator: Any, *, heartbeat_s: float = 0.01) -> None:
        """Step in lockstep with the other ranks of an expert-parallel group (see
        `inference/core/ep_step.py`). Every rank must then keep stepping while any has work: run
        the background loop (`start()`), or drive it with `step_until_ep_idle()`."""
        with self.calls.lock:
            self.core.set_ep_communicator(communicator, heartbeat_s=heartbeat_s)

    def step_until_ep_idle(self) -> list[RequestOutput]:
        """An expert-parallel rank without a loop: step with the peers until a round finds no
        rank with unfinished requests (all ranks return after the same round), or the group
        stopped; the outputs of `add_request`ed requests. A lost peer raises `EPPeerLostError`
        within its timeout."""
        if self.core.ep is None:
            raise EngineStateError("step_until_ep_idle: not an expert-parallel rank (set_ep_communicator first)")
        outputs: list[RequestOutput] = []
        while True:
            outputs += self.step()
            if self.core.ep.all_idle or self.core.ep.stopped:
                return outputs

    def step_for_waiter(self) -> None:
        """Without a loop, a thread waiting on a stream makes progress itself (one step or a nap)."""
        self.calls.step_for_waiter()

    @property
    def loop_running(self) -> bool:
        return self.calls.loop is not None

    def start(self, *, idle_wait: float = 0.005) -> None:
        """Run the step loop in a background thread; calls from other threads become commands."""
        self.calls.start(idle_wait)

    def stop(self, timeout: float = 30.0) -> None:
        """End the background loop after the commands already queued; requests stay in flight.
        An expert-parallel rank first stops its group with it (every rank's loop then idles)."""
        self.calls.stop(timeout)

    def seconds_since_loop_tick(self) -> Optional[float]:
        """How long ago the background loop last went round (None without a loop)."""
        return self.calls.seconds_since_tick()

    def _on_step_error(self, error: BaseException) -> None:
        """A step failed on the loop: fail the streams in flight and abort their requests, so no
        caller waits forever; the engine goes on serving new requests."""
        for channel in set(self._channels.values()):
            if isinstance(channel, RequestStream):
                channel.fail(error)
        self.core.abort_all()

    # ---- pause / suspend ---------------------------------------------------------------------

    def pause(self, mode: PauseMode = PauseMode.KEEP, *, timeout: Optional[float] = None,
              wait: bool = True) -> None:
        """Stop generating (see `PauseMode`); requests added meanwhile queue. With WAIT it returns
        once what was admitted has finished (stepping itself if no loop runs); with `wait=False`
        at once, and `wait_drained()` waits."""
        mode = PauseMode(mode)
        self.calls.run(self.core.pause, mode)
        if mode is PauseMode.WAIT and wait:
            self.wait_drained(timeout)

    def post_pause(self, mode: PauseMode = PauseMode.KEEP) -> Future:
        """`pause(mode)` without waiting: a `Future` resolved once the pause took effect, and with
        WAIT once what was admitted has finished (the loop steps it meanwhile)."""
        mode = PauseMode(mode)
        paused = self.post(lambda: self.pause(mode, wait=False))
        if mode is not PauseMode.WAIT:
            return paused
        drained: Future = Future()

        def wait_drained(done: Future) -> None:  # NOTE: on the loop, once the pause took effect
            if done.exception() is not None:
                drained.set_exception(done.exception())
                return
            self.when(self.core.drained).add_done_callback(
                lambda f: drained.set_exception(f.exception()) if f.exception() else drained.set_result(None))

        paused.add_done_callback(wait_drained)
        return drained

    def wait_drained(self, timeout: Optional[float] = None) -> None:
        """Return once nothing admitted is still in flight (what a WAIT pause waits for);
        `TimeoutError` after `timeout` seconds."""
        self.calls.wait_until(self.core.drained, timeout)

    def continue_(self) -> None:
        """Generate again after `pause()`."""
        self.calls.run(self.core.continue_)

    resume_generation = continue_

    def suspend(self, policy: Optional[SuspendPolicy] = None, *, offload_weights: bool = False,
                tags: Optional[Sequence[str]] = None, discard_weights: bool = False) -> SuspendReport:
        """Free the KV buffer and step workspaces (and, if asked, the engine's own weights), or the
        parts `tags` names (`kv_cache`, `weights`), each once; see `EngineCore.suspend`."""
        return self.calls.run(self.core.suspend, policy, offload_weights=offload_weights, tags=tags,
                              discard_weights=discard_weights)

    def resume(self, tags: Optional[Sequence[str]] = None) -> None:
        """Re-allocate what suspend freed (or the parts `tags` names); `ResumeMemoryError` (still
        suspended) if it can't."""
        self.calls.run(self.core.resume, tags)

    def reset_prefix_cache(self) -> None:
        self.calls.run(self.core.reset_prefix_cache)

    def end_session(self, session_id: str) -> bool:
        """A session's trajectory is over (SkyRL's `/finish_session`): its salted version's blocks are
        no longer kept for it, and a session refused as stale may start again; whether it was known."""
        return self.calls.run(lambda: self.core.end_session(session_id))

    def add_kv_event_listener(self, listener: KVEventListener) -> None:
        """Call `listener(event)` for each prefix-cache event from now on (stored, removed, all
        cleared; `inference.kv_cache.events`), on the thread that steps. A listener that raises is
        logged and never stops inference; keep it quick (it runs inside the step)."""
        self.calls.run(self.core.allocator.events.add_listener, listener)

    # ---- introspection -----------------------------------------------------------------------

    def kv_utilization(self) -> float:
        """Fraction of KV blocks held by requests now."""
        return self.core.kv_utilization()

    def peak_kv_utilization(self, since_step: int = 0) -> float:
        """Largest fraction of KV blocks in use during any step since `since_step`."""
        return self.calls.run(self.core.peak_kv_utilization, since_step)

    def stats(self) -> dict:
        return self.calls.run(self.core.stats)

    def waiting_by_client(self) -> dict[str, int]:
        """Samples not yet in a slot, per client that has some (`stats()` has their sum and count)."""
        return self.calls.run(self.core.scheduler.waiting_samples)
