"""vLLM's four weight-transfer phases (its RL API, `weight_sync.vllm_layout.VLLM_VERSION`), mapped
onto our staged update: whole or not at all, the version set at the commit.

    POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset, world_size}}
        -> join the trainer's weight-update group (rank 0 the trainer, this engine `rank_offset`)
    POST /start_weight_update          -> open a staged update (the old weights keep serving)
    POST /update_weights {"update_info": {names, dtype_names, shapes, packed, packed_buffer_size_bytes,
                                          packed_num_buffers}}       (any number of calls)
        -> receive those tensors, as vLLM's trainer broadcasts them, into the open update
    POST /update_weights {"weight_dir": DIR}   (prime-rl's) -> a safetensors directory, committed at once
    POST /finish_weight_update {"weight_version": V}  -> commit the open update (V: the version it
        commits under, None: the next)

Answers are vLLM's (`{"message": "Weight transfer initialized"}`, `"Weight update started"`,
`"Weights updated"`, `"Weight update finished"`), and so are its refusals: a missing `init_info` /
`update_info` or a body that is not JSON is 400 with vLLM's HTTPException body
`{"error": {"message", "type": "Bad Request", "param": null, "code": 400}}`; metadata its dataclasses
refuse (an unknown or missing field, lists of different lengths) is 400 `BadRequestError` with
vLLM's wording; what the engine refuses keeps our status (400 a bad request, 503 busy, 504 a
timeout). Where we differ on purpose: a failure anywhere (a broadcast, a tensor for another model,
a commit that misses tensors) aborts the whole update, and the old weights keep serving.

Read from vllm-project/vllm: `vllm/entrypoints/serve/dev/rlhf/api_router.py` (0100a212), the
dataclasses of `vllm/distributed/weight_transfer/nccl_engine.py` (04b06efe) and `base.py` (02f250b0).

Not served: vLLM's CUDA IPC `update_info` (`ipc_handles`): those are pickled torch reductions, and
nothing pickled is loaded here (`/update_weights_from_tensor` takes our msgpack handle instead).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Annotated, Any, Optional

import msgspec
from fastapi import APIRouter, Request, Response
from msgspec import Meta

from rollout.http.core.errors import from_exception
from rollout.http.core.front import HttpFront
from rollout.http.core.responses import front_of, json_response
from weight_sync import DistributedSource, Manifest, parse_weight_version
from weight_sync.vllm_layout import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, VLLM_GROUP

router = APIRouter()


class InitInfo(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `NCCLWeightTransferInitInfo`; `backend` is ours (None: gloo on CPU, nccl on GPU)."""

    master_address: str
    master_port: Annotated[int, Meta(ge=0, le=65535)]
    rank_offset: Annotated[int, Meta(ge=1)]
    world_size: Annotated[int, Meta(ge=2)]
    backend: Optional[str] = None


class UpdateInfo(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `NCCLWeightTransferUpdateInfo` (`packed_num_buffers` changes no byte on the wire)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[Annotated[int, Meta(ge=0)]]]
    packed: bool = False
    packed_buffer_size_bytes: Annotated[int, Meta(ge=1)] = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: Annotated[int, Meta(ge=1)] = DEFAULT_PACKED_NUM_BUFFERS
    is_checkpoint_format: bool = True  # NOTE: sent by TRL and slime; our loads are always in checkpoint names

    def __post_init__(self) -> None:
        for field in ("dtype_names", "shapes"):  # NOTE: vLLM's own wording
            if len(getattr(self, field)) != len(self.names):
                raise ValueError(f"`{field}` should be of the same size as `names`: got "
                                 f"{len(getattr(self, field))} and {len(self.names)}")


# ---- vLLM's error bodies -------------------------------------------------------------------------


class VllmRefusal(Exception):
    """A refusal answered in vLLM's error shape: `status`, `message`, and vLLM's `type` for it."""

    def __init__(self, status: int, message: str, type: str) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type


def _bad_body(message: str) -> VllmRefusal:
    """What vLLM's handler makes of its routes' `HTTPException(400, detail)`."""
    return VllmRefusal(400, message, HTTPStatus.BAD_REQUEST.phrase)


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError", 429: "RateLimitError",
               503: "ServiceUnavailableError", 504: "TimeoutError"}


def _refusal(exc: BaseException) -> VllmRefusal:
    if isinstance(exc, VllmRefusal):
        return exc
    err = from_exception(exc)
    return VllmRefusal(err.status, err.message, ERROR_TYPES.get(err.status, "InternalServerError"))


def _answer(refusal: VllmRefusal) -> Response:
    return json_response({"error": {"message": refusal.message, "type": refusal.type, "param": None,
                                    "code": refusal.status}}, status=refusal.status)


async def _body(request: Request, *, optional: bool = False) -> dict[str, Any]:
    raw = await request.body()
    if optional and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _bad_body("Invalid JSON format") from None
    if not isinstance(body, dict):
        raise VllmRefusal(400, f"expected a JSON object, got {type(body).__name__}", "BadRequestError")
    return body


def _parse(kind: type, value: Any, field: str) -> Any:
    """`value` as `kind`; a refusal worded as vLLM's `parse_init_info` / `parse_update_info` word theirs."""
    try:
        return msgspec.convert(value, kind)
    except (msgspec.ValidationError, ValueError) as exc:
        raise VllmRefusal(400, f"Invalid {field} for NCCLWeightTransferEngine: {exc}", "BadRequestError") from None


async def _run(call) -> Response:
    try:
        return await call()
    except Exception as exc:  # noqa: BLE001 (every refusal answers in vLLM's shape; the server goes on)
        return _answer(_refusal(exc))


# ---- the four phases -----------------------------------------------------------------------------


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> Response:
    async def call() -> Response:
        body = await _body(request)
        if body.get("init_info") is None:
            raise _bad_body("Missing 'init_info' in request body")
        info = _parse(InitInfo, body["init_info"], "init_info")
        front = front_of(request)
        # NOTE: vLLM's worker rank is rank_offset + its index among the engine's workers; we have one
        await front.client.init_weights_update_group(info.master_address, info.master_port, info.rank_offset,
                                                      info.world_size, VLLM_GROUP, info.backend,
                                                      timeout=front.timeout)
        return json_response({"message": "Weight transfer initialized"})
    return await _run(call)


async def _phase(request: Request, phase: Any, message: str, *, optional: bool = False) -> Response:
    """`phase(request, body)`, answered with vLLM's `{"message": ...}` or its refusal."""
    async def call() -> Response:
        await phase(request, await _body(request, optional=optional))
        return json_response({"message": message})
    return await _run(call)


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> Response:
    return await _phase(request, _start, "Weight update started", optional=True)


@router.post("/update_weights")
async def update_weights(request: Request) -> Response:
    return await _phase(request, _update_weights, "Weights updated")


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> Response:
    return await _phase(request, _finish, "Weight update finished", optional=True)


async def _start(request: Request, body: dict[str, Any]) -> None:
    """NOTE: `is_checkpoint_format` (TRL, slime, SkyRL) changes nothing here: names are HF's either way."""
    # NOTE: the engine's update, opened with no tensor, is held open until the finish: each
    # `/update_weights` then leaves it open (without a start, the call that completes the model commits)
    await _update(front_of(request), _source(finish=False))


async def _update_weights(request: Request, body: dict[str, Any]) -> None:
    front = front_of(request)
    if body.get("weight_dir") is not None and body.get("update_info") is None:  # prime-rl's
        if not isinstance(body["weight_dir"], str):
            raise VllmRefusal(400, "weight_dir: expected a path", "BadRequestError")
        await front.client.update_weights_from_disk(body["weight_dir"], timeout=front.timeout)
        return
    if body.get("update_info") is None:
        raise _bad_body("Missing 'update_info' in request body")
    if isinstance(body["update_info"], dict) and "ipc_handles" in body["update_info"]:
        raise VllmRefusal(400, "update_info.ipc_handles: vLLM's CUDA IPC handles are pickled torch reductions, "
                          "and nothing pickled is loaded here; broadcast the weights (packed or not), or send "
                          "weight_sync's msgpack handle to /update_weights_from_tensor", "BadRequestError")
    info = _parse(UpdateInfo, body["update_info"], "update_info")
    source = _source(info.names, info.dtype_names, info.shapes,
                     info.packed_buffer_size_bytes if info.packed else None, finish=None)
    await _update(front, source)  # NOTE: a failure aborts the engine's whole update, a held one too


async def _finish(request: Request, body: dict[str, Any]) -> None:
    version = parse_weight_version(body.get("weight_version"))
    await _update(front_of(request), _source(version=version, finish=True))


async def _refuse_ipc(request: Request, body: dict[str, Any]) -> None:
    raise VllmRefusal(400, "update_weights_ipc: its update_info carries pickled CUDA IPC handles, and nothing "
                      "pickled is loaded here; broadcast the weights (update_weights_nccl) instead", "BadRequestError")


async def _reset_prefix_cache(request: Request, body: dict[str, Any]) -> None:
    await front_of(request).client.reset_prefix_cache()


# /collective_rpc: the worker methods RL frameworks call, mapped onto the same calls as the routes
# (SkyRL's NewInferenceWorkerWrap: skyrl_start_weight_update, update_weights_nccl,
# skyrl_finish_weight_update, update_weights_ipc); any other method is refused, naming these
RPC_METHODS = {
    "skyrl_start_weight_update": _start,
    "start_weight_update": _start,
    "update_weights_nccl": _update_weights,
    "update_weights": _update_weights,
    "skyrl_finish_weight_update": _finish,
    "finish_weight_update": _finish,
    "update_weights_ipc": _refuse_ipc,
    "reset_prefix_cache": _reset_prefix_cache,
}


# NeMo-RL's vLLM worker extension, known and refused with the reason: its group is vLLM's
# StatelessProcessGroup with PyNccl (a wire of its own, not torch.distributed's), its IPC pickled
NOT_SERVED = {
    "init_collective": "NeMo-RL's weight group is vLLM's StatelessProcessGroup with PyNccl, which this engine "
                       "does not join; join vLLM's by /init_weight_transfer_engine",
    "update_weights_from_collective": "it receives over NeMo-RL's PyNccl group (see init_collective); broadcast "
                                      "in vLLM's layout with /update_weights instead",
    "update_weights_from_ipc_handles": "its handles are pickled CUDA IPC handles, and nothing pickled is loaded "
                                       "here",
    "update_weights_via_ipc_zmq": "its handles are pickled CUDA IPC handles, and nothing pickled is loaded here",
    "report_device_id": "it names a GPU for CUDA IPC, which is refused here (pickled handles)",
    "prepare_refit_info": "it sets up NeMo-RL's own refit (see update_weights_from_collective)",
}


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> Response:
    """vLLM's `{"method", "args", "kwargs", "timeout"}`, answered `{"results": [one per worker]}`
    (one worker here); the methods served are `RPC_METHODS`' (see above), keyword arguments only."""
    async def call() -> Response:
        body = await _body(request)
        method = body.get("method")
        if method is None:
            raise _bad_body("Missing 'method' in request body")
        handler = RPC_METHODS.get(method)
        if method in NOT_SERVED:
            raise VllmRefusal(400, f"collective_rpc: {method} is not served: {NOT_SERVED[method]}", "BadRequestError")
        if handler is None:
            raise VllmRefusal(400, f"collective_rpc: method {method!r} is not served here; served: "
                              f"{sorted(RPC_METHODS)}", "BadRequestError")
        if body.get("args"):
            raise VllmRefusal(400, f"collective_rpc: {method} takes keyword arguments only (kwargs)",
                              "BadRequestError")
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise VllmRefusal(400, "collective_rpc: kwargs must be an object", "BadRequestError")
        await handler(request, kwargs)
        return json_response({"results": [None]})
    return await _run(call)


def _source(names: Optional[list[str]] = None, dtypes: Optional[list[str]] = None,
            shapes: Optional[list[list[int]]] = None, packed_buffer_bytes: Optional[int] = None, *,
            version: Optional[int] = None, finish: Optional[bool]) -> DistributedSource:
    """One phase as a call of a staged sequence over vLLM's group (no tensor: start, or finish)."""
    manifest = Manifest(names=list(names or []), dtypes=list(dtypes or []), shapes=[list(x) for x in shapes or []],
                        version=version)
    return DistributedSource(manifest=manifest, group_name=VLLM_GROUP, finish=finish,
                             packed_buffer_bytes=packed_buffer_bytes)


async def _update(front: HttpFront, source: DistributedSource) -> int:
    return await front.client.update_weights(source, timeout=front.timeout)
