"""vLLM's native RL routes: the control plane and token-in, token-out generation.

Names, fields, defaults and answers are vLLM's (`VLLM_API_VERSION`: its `dev/rlhf`, `dev/sleep`,
`dev/cache`, `dev/server_info` routers and `/inference/v1/generate`), so the frameworks that drive
vLLM (SkyRL's remote client, TRL's async GRPO, prime-rl, verifiers) drive this front unchanged:

* `/pause` (`mode` abort / wait / keep as a query; `clear_cache`, default true, resets the prefix
  cache after an abort or a wait, never for keep) -> `{"status": "paused"}`; `/resume` ->
  `{"status": "resumed"}`; `/is_paused`; `/abort_requests` (`request_ids`, none: all) ->
  `{"status": "aborted", "aborted": n}`.
* `/sleep` (`level` 1: the KV cache freed, the weights moved to host; 2: the weights dropped, a
  weight update must load new ones) and `/wake_up`, by part with `tags` (`kv_cache`, `weights`;
  each part sleeps and wakes once, so a repeated call changes nothing), answering 200 (vLLM sends
  no body; here `{"status", "level", "tags"}` as received); `/is_sleeping` (true while any part
  sleeps). `/pause` answers `mode` and `clear_cache` as received beside vLLM's `status`.
* `/reset_prefix_cache` (`reset_running_requests`) -> `{"success": bool}`: false while requests
  hold blocks, as vLLM answers, unless `reset_running_requests` (then the running are recomputed).
* `/update_weight_version` (`new_version`; SGLang's `abort_all_requests`, default false here: the
  requests in flight go on, their later tokens under the new version), `/get_world_size` (one
  worker per engine: 1, or a router's replicas up), `/weight_info` (`{"weight_version"}`),
  `/finish_session?session_id=` (SkyRL's: the front forgets the session's turns),
  `/server_info` (`config_format` text or json: `vllm_config` with the fields clients read:
  model, served names, dtype, max model length, block size, parallel sizes, no LoRA).
* `/inference/v1/generate`: `token_ids`, `sampling_params` (vLLM's `SamplingParams` fields),
  `model`, `request_id`, `cache_salt`, `stream`; answers `request_id`, `choices` (each
  `token_ids`, `finish_reason`, `logprobs` as chat's with `token_id:N` tokens) and
  `prompt_logprobs`; beyond vLLM, each choice's `weight_versions`, the policy version of each span
  of its tokens (`[{"version", "start", "end"}]`: end exclusive), in the stream too.
  `/inference/v1/abort_requests` (`request_ids`) aborts those.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from inference import PauseMode, SuspendPolicy, UpdatePolicy
from inference.core.states import MEMORY_TAGS
from rollout.http.core import structured
from rollout.http.core.disconnects import unless_disconnected
from rollout.http.core.errors import APIError, engine_call
from rollout.http.core.front import HttpFront
from rollout.http.core.generation import Generation, GenSpec, Sample, version_spans
from rollout.http.core.logprobs import chat_top, prompt_entries
from rollout.http.core.responses import front_of, json_response, sse
from rollout.http.core.sampling import sampling_params
from rollout.http.core.schemas import (
    MAX_N,
    MAX_PENALTY,
    MAX_STOP,
    MAX_WORDS,
    Strict,
    StructuredOutputsBody,
    refuse,
)
from rollout.http.sglang.sglang_routes import server_args
from weight_sync import ManifestError, VersionSource, parse_weight_version

router = APIRouter()
VLLM_API_VERSION = "0.22.1"  # the vLLM release whose RL routes these mirror
PAUSE_MODES = {"abort": PauseMode.ABORT, "wait": PauseMode.WAIT, "keep": PauseMode.KEEP}


def vllm_error(status: int, message: str) -> JSONResponse:
    """vLLM's dev routes answer `{"error": message}`."""
    return JSONResponse({"error": message}, status_code=status)


async def _state(front: HttpFront) -> str:
    return (await engine_call(front.client.stats())).get("engine/state", "running")


# ---- control -------------------------------------------------------------------------------------


@router.post("/pause")
async def pause(request: Request, mode: str = Query("abort"), wait_for_inflight_requests: bool = Query(False),
                clear_cache: bool = Query(True)) -> Response:
    if mode not in PAUSE_MODES:
        return vllm_error(400, f"Invalid pause mode {mode!r}: expected one of abort, wait, keep.")
    pause_mode = PAUSE_MODES[mode]
    if wait_for_inflight_requests and pause_mode is PauseMode.ABORT:  # NOTE: vLLM's deprecated spelling of wait
        pause_mode = PauseMode.WAIT
    front = front_of(request)
    await engine_call(front.client.pause(pause_mode))
    if clear_cache and pause_mode is not PauseMode.KEEP:
        await engine_call(front.client.reset_prefix_cache())
    # NOTE: vLLM answers the status; the parameters as received come too (SkyRL's client tests read them)
    return json_response({"status": "paused", "mode": pause_mode.value,
                          "clear_cache": request.query_params.get("clear_cache", "true")})


@router.post("/resume")
async def resume(request: Request) -> Response:
    await engine_call(front_of(request).client.continue_())
    return json_response({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(request: Request) -> Response:
    return json_response({"is_paused": await _state(front_of(request)) == "paused"})


class AbortRequests(Strict):
    request_ids: Optional[list[str]] = None


async def _abort(front: HttpFront, request_ids: Optional[list[str]]) -> int:
    return await front.abort_where(lambda rid: not request_ids or rid in request_ids)


@router.post("/abort_requests")
async def abort_requests(request: Request) -> Response:
    body = await _body(request, AbortRequests)
    aborted = await _abort(front_of(request), body.request_ids)
    return json_response({"status": "aborted", "aborted": aborted})


@router.post("/inference/v1/abort_requests")
async def abort_generate_requests(request: Request) -> Response:
    body = await _body(request, AbortRequests)
    if body.request_ids is None:
        raise APIError(400, "Missing 'request_ids' in request body", param="request_ids")
    await _abort(front_of(request), body.request_ids)
    return Response(status_code=200)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, reset_running_requests: bool = Query(False),
                             reset_external: bool = Query(False)) -> Response:
    """`reset_external`: there is no external (connector) cache, so nothing more to reset."""
    front = front_of(request)
    stats = await engine_call(front.client.stats())
    busy = float(stats.get("kv_utilization", 0.0) or 0.0) > 0.0
    if busy and not reset_running_requests:
        return json_response({"success": False})
    if busy:  # NOTE: the running give their blocks back (recomputed from their tokens), then the reset
        was_paused = stats.get("engine/state") == "paused"
        await engine_call(front.client.pause(PauseMode.RETRACT))
        try:
            await engine_call(front.client.reset_prefix_cache())
        finally:
            if not was_paused:  # NOTE: a caller's own pause stays in place
                await engine_call(front.client.continue_())
    else:
        await engine_call(front.client.reset_prefix_cache())
    return json_response({"success": True})


class UpdateWeightVersion(Strict):
    """vLLM's body (`new_version`) and SGLang's (`abort_all_requests` too; SGLang aborts by default,
    this front keeps in-flight work unless asked, and says which it did)."""

    new_version: Union[Annotated[str, Field(min_length=1, max_length=64)], Annotated[int, Field(ge=0)]]
    abort_all_requests: bool = False


@router.post("/update_weight_version")
async def update_weight_version(body: UpdateWeightVersion, request: Request) -> Response:
    """The weights serve under `new_version` from now on (nothing moves; the prefix cache starts
    over, as after any update); requests in flight go on, their later tokens under the new version."""
    try:
        version = parse_weight_version(body.new_version)
    except ManifestError as exc:
        raise APIError(400, str(exc), param="new_version") from None
    policy = UpdatePolicy.ABORT if body.abort_all_requests else UpdatePolicy.KEEP
    await engine_call(front_of(request).client.update_weights(VersionSource(version=version), policy=policy))
    kept = "aborted" if body.abort_all_requests else "kept"
    return json_response({"success": True, "new_version": body.new_version,
                          "message": f"Weight version updated to {body.new_version}; requests in flight {kept}."})


@router.post("/finish_session")
async def finish_session(request: Request,
                         session_id: Annotated[str, Query(min_length=1, max_length=256)]) -> Response:
    """SkyRL's call at a trajectory's end (its router's route): the front forgets the session's
    turns. NOTE: behind our router the session's sticky replica ages out of the router's LRU."""
    released = front_of(request).sessions.finish(session_id)
    return json_response({"status": "ok", "session_id": session_id, "released": released})


async def data_parallel_size(front: HttpFront) -> int:
    """The engines behind this front: a router's replicas in its weight group (up, or lagging and
    brought back by the next update; as vLLM's data parallel ranks, each one worker), else 1."""
    stats = await engine_call(front.client.stats())
    return int(stats.get("replicas_weight_group", stats.get("replicas_up", 1)))


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: bool = Query(True)) -> Response:
    # NOTE: an engine is one worker (no tensor or pipeline parallelism across processes here)
    return json_response({"world_size": await data_parallel_size(front_of(request)) if include_dp else 1})


@router.get("/weight_info")
async def weight_info(request: Request) -> Response:
    return json_response({"weight_version": str(await engine_call(front_of(request).policy_version()))})


@router.get("/server_info")
async def server_info(request: Request, config_format: str = Query("text")) -> Response:
    if config_format not in ("text", "json"):
        raise APIError(400, f"config_format must be text or json, got {config_format!r}", param="config_format")
    front = front_of(request)
    stats = await engine_call(front.client.stats())
    health = await engine_call(front.client.health(timeout=20.0))
    cfg = front.config
    config = {
        "model_config": {"model": cfg.model_path or cfg.model_name, "served_model_name": list(front.model_names),
                         "tokenizer": cfg.model_path or cfg.model_name,
                         # NOTE: vLLM's JSON dump stringifies the torch.dtype ("torch.bfloat16"); TRL strips it
                         "dtype": f"torch.{stats.get('engine/dtype')}",
                         "max_model_len": cfg.max_model_len, "vocab_size": front.codec.vocab_size},
        "cache_config": {"block_size": stats.get("engine/block_size"),
                         "num_gpu_blocks": stats.get("engine/total_blocks"), "enable_prefix_caching": True},
        "parallel_config": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                            "data_parallel_size": int(stats.get("replicas_up", 1)), "world_size": 1},
        # NOTE: vLLM's field names; None where the engine serves no adapters (max_loras 0)
        "lora_config": {"max_loras": stats.get("engine/max_loras"), "max_lora_rank": stats.get("engine/max_lora_rank"),
                        "loaded": sorted(front.loras)} if stats.get("engine/max_loras") else None,
        "rollout_engine": {"policy_version": stats.get("policy_version"), "state": stats.get("engine/state"),
                           "generating": health.serving_error is None, "serving_error": health.serving_error,
                           "vllm_api_version": VLLM_API_VERSION},
    }
    # NOTE: one handler for vLLM's and SGLang's `/server_info`: SGLang's server args beside `vllm_config`
    vllm_config = config if config_format == "json" else str(config)
    return json_response({**server_args(front, stats), "vllm_config": vllm_config})


# ---- sleep ---------------------------------------------------------------------------------------


def _tags(request: Request) -> Optional[list[str]]:
    """The request's tags, checked (the client's calls take their names)."""
    tags = request.query_params.getlist("tags") or None
    bad = [t for t in tags or () if t not in MEMORY_TAGS]
    if bad:
        raise APIError(400, f"Unknown sleep tags {bad}: expected {list(MEMORY_TAGS)}", param="tags")
    return tags


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1)) -> Response:
    """Level 1: the KV cache freed, the weights moved to host (kept); level 2: the weights dropped
    (a complete weight update must load new ones before the engine generates). `tags`: only those
    parts; each part sleeps once (asleep already: nothing changes)."""
    if level not in (1, 2):
        raise APIError(400, f"Sleep level must be 1 or 2, got {level}", param="level")
    asked = _tags(request)
    await engine_call(front_of(request).client.suspend(SuspendPolicy.RECOMPUTE, tags=asked or list(MEMORY_TAGS),
                                                 discard_weights=level == 2))
    return json_response({"status": "sleeping", "level": level, "tags": asked})


@router.post("/wake_up")
async def wake_up(request: Request) -> Response:
    """`tags`: only those parts (the weights first, to load new ones, then the KV cache); a part
    awake already is left as it is, so a wake-up of an awake engine answers 200, as vLLM's."""
    tags = _tags(request)
    # NOTE: every part named, never "resume if asleep": the engine's loop decides what sleeps, so
    # wake-ups sent together (SkyRL sends one to each of a server's URLs) wake it once, all 200
    await engine_call(front_of(request).client.resume(tags=tags or list(MEMORY_TAGS)))
    return json_response({"status": "awake", "tags": tags})


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> Response:
    return json_response({"is_sleeping": await _state(front_of(request)) == "suspended"})


# ---- token in, token out -------------------------------------------------------------------------


class VllmSamplingParams(Strict):
    """vLLM's `SamplingParams` as a request carries it (the fields this engine honours; the rest
    only at their neutral values, so a client's defaults pass and nothing is silently ignored)."""

    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Optional[Annotated[float, Field(ge=0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[int, Field(ge=-1)]] = None
    min_p: Optional[Annotated[float, Field(ge=0, lt=1)]] = None
    seed: Optional[Annotated[int, Field(ge=0, lt=2**63)]] = None
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = 16
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = None
    ignore_eos: bool = False
    logprobs: Optional[Annotated[int, Field(ge=0)]] = None  # NOTE: at most the server's max_logprobs
    prompt_logprobs: Optional[Annotated[int, Field(ge=0)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    frequency_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0, le=MAX_PENALTY)]] = None
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None
    allowed_token_ids: Optional[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]] = None
    # NOTE: the bounds of /v1/completions' fields: each word is tokenized twice before anything runs
    bad_words: Optional[Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_WORDS)]] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: Literal[True] = True
    detokenize: bool = True
    logprobs_mode: Optional[Literal["raw", "processed", "raw_logprobs", "processed_logprobs"]] = None
    # vLLM's RequestOutputKind, for a stream: 0 cumulative (each chunk all ids so far), 1 delta (the
    # new ids; a stream's default), 2 final only (one chunk at the end); an answer not streamed is whole
    output_kind: Optional[Literal[0, 1, 2]] = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise refuse("stop", f"stop may hold at most {MAX_STOP} strings, got {len(stops)}.")
        return tuple(s for s in stops if s)


class GenerateRequest(Strict):
    """vLLM's token-in, token-out request (`/inference/v1/generate`)."""

    request_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    sampling_params: VllmSamplingParams = Field(default_factory=VllmSamplingParams)
    model: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[Literal[None]] = None  # NOTE: the answer has no usage to stream
    cache_salt: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    priority: Literal[0] = 0
    features: Optional[Literal[None]] = None  # multimodal features: a text model takes none
    kv_transfer_params: Optional[Literal[None]] = None


@router.post("/inference/v1/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    front = front_of(request)
    body.model = front.check_model(body.model)
    sp = body.sampling_params
    front.check_ids([body.token_ids], "token_ids")
    max_tokens = front.completion_budget([body.token_ids], sp.max_tokens, "token_ids")
    rid = body.request_id or f"generate-{uuid.uuid4().hex}"
    if rid in front.inflight:
        raise APIError(400, f"request_id {rid!r} is already in flight", param="request_id")
    top, prompt_top = sp.logprobs, sp.prompt_logprobs
    fields = SimpleNamespace(**{name: getattr(sp, name) for name in VllmSamplingParams.model_fields},
                             cache_salt=body.cache_salt, response_format=None)
    sampling = sampling_params(front.codec, fields, n=sp.n, max_tokens=max_tokens, logprobs=top,
                               prompt_logprobs=prompt_top, structured=structured.from_openai(fields),
                               **front.logprob_rules())
    sampling = front.with_adapter(sampling, body.model)
    spec = GenSpec([body.token_ids], sp.n, sampling, stops=sp.stop_strings(),
                   include_stop=sp.include_stop_str_in_output, skip_special_tokens=sp.skip_special_tokens,
                   stream=bool(body.stream), session_id=request.headers.get("X-Session-ID"), rid=rid)
    gen = front.generation(spec)
    if body.stream:
        return StreamingResponse(_chunks(front, gen, rid, top, sp.output_kind), media_type="text/event-stream")
    samples = await unless_disconnected(request, gen.run())  # NOTE: a client that left frees its requests now
    out = {"request_id": rid, "choices": [_choice(front, s, 0, s.ids, top, s.finish_reason) for s in samples],
           "prompt_logprobs": None}
    if prompt_top is not None:
        out["prompt_logprobs"] = prompt_entries(body.token_ids, samples[0].prompt_logprobs, prompt_top,
                                                lambda t: front.token_text(t, True), samples[0].prompt_ranks)
    return json_response(out)


def _choice(front: HttpFront, s: Sample, start: int, ids: list[int], top: Optional[int],
            finish_reason: Optional[str]) -> dict[str, Any]:
    return {"index": s.index, "token_ids": ids, "finish_reason": finish_reason,
            "logprobs": None if top is None else _logprobs(front, s, start, ids, top),
            "weight_versions": version_spans(s.versions[start:start + len(ids)], start)}


def _logprobs(front: HttpFront, s: Sample, start: int, ids: list[int], top: int) -> dict[str, Any]:
    content = []
    for j, t in enumerate(ids):
        lp = s.logprobs[start + j]
        row = s.top_logprobs[start + j] if s.top_logprobs is not None else None
        tops = [{"token": f"token_id:{alt}", "logprob": alt_lp} for alt, alt_lp in chat_top(row, top, t, lp)]
        content.append({"token": f"token_id:{t}", "logprob": lp, "top_logprobs": tops})
    return {"content": content}


CUMULATIVE, FINAL_ONLY = 0, 2


async def _chunks(front: HttpFront, gen: Generation, rid: str, top: Optional[int],
                  kind: Optional[int]) -> AsyncIterator[bytes]:
    try:
        if kind == FINAL_ONLY:
            for s in await gen.run():
                yield sse({"request_id": rid, "choices": [_choice(front, s, 0, s.ids, top, s.finish_reason)]})
        else:
            async for d in gen.deltas():
                start, ids = (0, d.sample.ids[:d.start + len(d.ids)]) if kind == CUMULATIVE else (d.start, d.ids)
                yield sse({"request_id": rid, "choices": [_choice(front, d.sample, start, ids, top, d.finish_reason)]})
    except APIError as err:
        yield sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}})
    yield b"data: [DONE]\n\n"


async def _body(request: Request, model: type[Strict]) -> Any:
    raw = await request.body()
    if not raw.strip():
        return model()
    try:
        return model.model_validate_json(raw)
    except ValueError as exc:
        raise APIError(400, f"Invalid request body: {exc}".splitlines()[0], param=None) from None
