"""The one translation layer between the engine's types and the wire's.

Enums and `SamplingParams` need none (the wire carries the engine's own). What does: a finished
`RequestOutput` and its `SampleOutput` (packed arrays, routes),
a received `SampleOutput` and the client's `Rollout`, and exceptions and their `ErrorReply`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from inference.errors import (
    ContextErrorFactory,
    ContextOverflowError,
    EngineStateError,
    LoRANotFoundError,
    OverloadedError,
    WeightsUnavailableError,
)
from inference.lora import AdapterInfo
from inference.request import RequestOutput
from rollout.types import Rollout
from rollout.wire.codec import ProtocolError
from rollout.wire.kinds import ErrorCode
from rollout.wire.messages import (
    ErrorReply,
    HealthInfo,
    LoraInfo,
    RoutedExperts,
    SampleOutput,
)

__all__ = ["error_from_reply", "error_reply", "output_from_wire", "output_to_wire"]


# ---- errors across the wire ------------------------------------------------------------------


def error_reply(exc: BaseException, request_id: Optional[str] = None) -> ErrorReply:
    """The reply for an exception raised while serving a request (the server's side)."""
    if isinstance(exc, ProtocolError):
        return ErrorReply(code=exc.code, message=exc.message, request_id=request_id or exc.request_id)
    if isinstance(exc, ContextOverflowError):
        return ErrorReply(code=ErrorCode.CONTEXT_OVERFLOW, message=str(exc), request_id=request_id,
                          context_error=ContextErrorFactory.serialize(exc))
    if isinstance(exc, OverloadedError):
        code = ErrorCode.OVERLOADED
    elif isinstance(exc, WeightsUnavailableError):
        code = ErrorCode.NO_WEIGHTS
    elif isinstance(exc, EngineStateError):
        code = ErrorCode.ENGINE_STATE
    elif isinstance(exc, LoRANotFoundError):
        code = ErrorCode.NOT_FOUND
    elif isinstance(exc, ValueError):
        code = ErrorCode.INVALID_REQUEST
    else:
        code = ErrorCode.INTERNAL
    return ErrorReply(code=code, message=f"{type(exc).__name__}: {exc}", request_id=request_id)


def error_from_reply(reply: ErrorReply) -> Exception:
    """The exception an `ErrorReply` stands for (the client's side): a `ContextOverflowError`
    subclass for CONTEXT_OVERFLOW with a readable `context_error`, else a `ProtocolError`."""
    if reply.code is ErrorCode.CONTEXT_OVERFLOW and reply.context_error is not None:
        try:
            return ContextErrorFactory.deserialize(reply.context_error)
        except (KeyError, TypeError, ValueError):
            pass  # an unreadable context error still comes back, as the ProtocolError below
    return ProtocolError(reply.code, reply.message, reply.request_id)


# ---- converters to and from the engine's types -----------------------------------------------


def health_of(engine, deadline_s: float) -> HealthInfo:
    """An engine's health from its loop's last tick (never waits for it: a wedged loop must show)."""
    since = engine.seconds_since_loop_tick()
    since = float("inf") if since is None else since
    error = engine.weights.serving_error  # NOTE: a read of one attribute, off the loop like the tick's
    return HealthInfo(healthy=since <= deadline_s, seconds_since_loop_tick=min(since, 1e9),
                      state=engine.state, policy_version=engine.policy_version,
                      serving_error=None if error is None else error[:1024])


def engine_figures(engine) -> dict:
    """What a served engine reports in its stats (on its loop: `engine.stats()` and KV use)."""
    figures = engine.stats()
    figures["kv_utilization"] = engine.kv_utilization()
    return figures


def loras_to_wire(infos: Sequence[AdapterInfo]) -> list[LoraInfo]:
    """The engine's loaded adapters as the wire lists them."""
    return [LoraInfo(name=i.name, version=i.version, rank=i.rank, path=i.path) for i in infos]


def output_to_wire(out: RequestOutput, request_id: str, *, n: int) -> SampleOutput:
    """A finished sample as its reply; `request_id` is the client's, `n` its Generate's group size."""
    return SampleOutput(
        request_id=request_id,
        sample_index=out.sample_index,
        n=n,
        prompt_len=len(out.prompt_token_ids),
        token_ids=out.generated_token_ids,
        logprobs=out.logprobs,
        versions=out.token_versions,
        finish_reason=out.finish_reason,
        top_logprobs=out.top_logprobs,
        prompt_logprobs=out.prompt_logprobs,
        prompt_logprob_ranks=out.prompt_logprob_ranks,
        ttft=out.time_to_first_token,
        latency=out.latency,
        num_preemptions=out.num_preemptions,
        routed_experts=_routes_to_wire(out.routed_experts),
        cached_tokens=out.cached_tokens,
        lora_version=out.lora_version,
    )


def _routes_to_wire(routes: Optional[np.ndarray]) -> Optional[RoutedExperts]:
    if routes is None:
        return None
    _, layers, k = routes.shape
    return RoutedExperts(layers=layers, k=k, experts=np.ascontiguousarray(routes, dtype=np.int32).reshape(-1))


def output_from_wire(msg: SampleOutput, prompt_ids: Sequence[int], group: int) -> Rollout:
    """A received sample as a `Rollout` of the client's prompt `prompt_ids` (group `group`).

    Log-probs come back as float32 values (the engine computes them in float32).
    """
    if len(prompt_ids) != msg.prompt_len:
        raise ValueError(f"output_from_wire: {msg.request_id!r} was sampled from a prompt of {msg.prompt_len} "
                         f"tokens, got prompt_ids of {len(prompt_ids)}")
    return Rollout(
        prompt_ids=[int(t) for t in prompt_ids],
        completion_ids=msg.token_ids.tolist(),
        logprobs=msg.logprobs.tolist(),
        versions=msg.versions.tolist(),
        finish_reason=msg.finish_reason,
        group=group,
        sample_index=msg.sample_index,
        top_logprobs=None if msg.top_logprobs is None else [dict(d) for d in msg.top_logprobs],
        routed_experts=None if msg.routed_experts is None else msg.routed_experts.array,
        cached_tokens=msg.cached_tokens,
        lora_version=msg.lora_version,
    )
