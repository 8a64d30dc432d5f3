"""Typed errors for requests that do not fit the context, and their wire form.

A `ContextOverflowError` says whether it is transient (the request may fit later, once other
requests finish) or permanent (it can never fit this engine). Errors cross process boundaries as
plain dicts (`ContextErrorFactory.serialize`/`deserialize`), never pickled.
"""

from __future__ import annotations

from typing import Any, Optional


class ContextOverflowError(Exception):
    """Base class: a request does not fit the context now (transient) or ever (permanent)."""

    def __init__(self, request_id: Optional[int], message: Optional[str] = None, *, is_transient: bool = True):
        self.request_id = request_id
        self.message = message or ""
        self.is_transient = is_transient
        kind = "transient" if is_transient else "permanent"
        super().__init__(f"request {request_id}: {self.message} ({kind})")


class RequestOverflowError(ContextOverflowError):
    """Adding the request would exceed the maximum number of requests."""


class TokenOverflowError(ContextOverflowError):
    """Adding the request would exceed the maximum number of tokens in a step."""


class MaxSequenceLengthOverflowError(ContextOverflowError):
    """Prompt plus generated tokens would exceed the maximum sequence length; never transient."""

    def __init__(self, request_id: Optional[int], message: Optional[str] = None, **_: Any):
        super().__init__(request_id, message, is_transient=False)


class BlockOverflowError(ContextOverflowError):
    """Not enough KV blocks (free or evictable) for the request."""


class ActiveRequestCountOverflowError(ContextOverflowError):
    """More active requests were asked for than the context was sized for; never transient."""

    def __init__(self, max_request_count: int, active_request_count: int, **_: Any):
        self.max_request_count = max_request_count
        self.active_request_count = active_request_count
        super().__init__(
            None,
            f"{active_request_count} active requests exceed max_requests={max_request_count}",
            is_transient=False,
        )


class TensorStateDeallocatedError(ContextOverflowError):
    """The context's buffers are deallocated (the engine is suspended); retry after resume."""


_ERROR_TYPES: dict[str, type[ContextOverflowError]] = {
    cls.__name__: cls
    for cls in (
        ContextOverflowError,
        RequestOverflowError,
        TokenOverflowError,
        MaxSequenceLengthOverflowError,
        BlockOverflowError,
        ActiveRequestCountOverflowError,
        TensorStateDeallocatedError,
    )
}


class ContextErrorFactory:
    """Turns context errors into plain dicts and back (msgpack-safe: str, int, bool, None)."""

    @classmethod
    def serialize(cls, error: ContextOverflowError) -> dict:
        if not isinstance(error, ContextOverflowError):
            raise TypeError(f"expected a ContextOverflowError, got {type(error).__name__}")
        obj = {
            "type": type(error).__name__,
            "request_id": error.request_id,
            "message": error.message,
            "is_transient": error.is_transient,
        }
        if isinstance(error, ActiveRequestCountOverflowError):
            obj["max_request_count"] = error.max_request_count
            obj["active_request_count"] = error.active_request_count
        return obj

    @classmethod
    def deserialize(cls, obj: dict) -> ContextOverflowError:
        try:
            error_type = _ERROR_TYPES[obj["type"]]
        except KeyError as exc:
            raise ValueError(f"unknown context error type in {obj!r}") from exc
        if error_type is ActiveRequestCountOverflowError:
            return error_type(obj["max_request_count"], obj["active_request_count"])
        if error_type is MaxSequenceLengthOverflowError:
            return error_type(obj["request_id"], obj["message"])
        return error_type(obj["request_id"], obj["message"], is_transient=obj["is_transient"])


class EngineStateError(RuntimeError):
    """An operation is not allowed in the engine's current state (e.g. resume while running)."""


class WeightsUnavailableError(EngineStateError):
    """The engine holds no weights fit to serve until a complete weight update loads them (a
    level-2 sleep discarded them, or an in-place update was aborted half-written). Unlike other
    state refusals, waiting does not end it: only the trainer's update does, so a client should
    not retry on a timer (an HTTP front says so: `x-should-retry: false`)."""


class OverloadedError(RuntimeError):
    """The engine refuses new work for now: its waiting queue is at its configured bound. Nothing
    about the request is wrong; retry after `retry_after_s` (a server answers OVERLOADED, an HTTP
    front 429 with `Retry-After`)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class StaleSessionError(ValueError):
    """A turn of a session that started more than `max_staleness` policy versions ago, under
    `StalePolicy.ABORT`: its trajectory can no longer be trained on. End the session and start a
    new one (a server answers INVALID_REQUEST, an HTTP front 400)."""


class ResumeMemoryError(MemoryError):
    """Resume cannot get the memory it needs; the engine stays suspended and usable."""


class WeightNameError(KeyError):
    """A weight update names a tensor the model does not have, or lacks one it needs."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class WeightShapeError(ValueError):
    """A weight update's tensor has the wrong shape or a non-floating dtype."""


class LoRAError(ValueError):
    """Base class: an adapter cannot be loaded, found or unloaded; nothing changed, the engine
    serves on. `http_status` is what an HTTP front answers (vLLM's: 400, or 404 for a name it does
    not know)."""

    http_status = 400


class LoRALoadError(LoRAError):
    """An adapter's directory or files are missing or unreadable, or its config is not a LoRA one."""


class LoRAShapeError(LoRAError):
    """An adapter tensor's shape does not fit the base model's projection (or A and B disagree)."""


class LoRATargetError(LoRAError):
    """An adapter targets modules this model cannot adapt (e.g. embeddings, `modules_to_save`),
    or uses a LoRA variant the engine does not compute (DoRA, trained biases)."""


class LoRACapacityError(LoRAError):
    """Past `max_loras` adapters resident, or an adapter's rank above `max_lora_rank`."""


class LoRANotFoundError(LoRAError):
    """A request or an unload names an adapter that is not loaded."""

    http_status = 404


class LoRAInUseError(LoRAError):
    """Unloading an adapter that requests in flight still use (they are pinned to it), or loading the
    next version of a shared (aliased) one while they do: retry once they finished, or abort them."""
