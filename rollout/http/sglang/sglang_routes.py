"""SGLang-compatible native routes, with the request and response names of SGLang's documentation.

Pinned to SGLang's docs as of v0.5.6 and later (`pause_generation` takes a `mode` from 0.5.6 on):
docs/basic_usage/native_api, docs/basic_usage/sampling_params (`/generate`), and
docs/advanced_features/sglang_for_rl (pause / continue, memory occupation, weight updates).
`SGLANG_API_VERSION` records it; the tests pin the shapes.

* `/generate`: `text` or `input_ids` (one prompt or a batch), `sampling_params` (SGLang's names),
  `rid`, `return_logprob`, `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`,
  `return_routed_experts`, `extra_key` (the engine's cache salt), `stream`. Answer:
  `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "weight_version", "weight_versions" (ours: the version of each span of
  tokens), "e2e_latency", "output_token_logprobs" ([logprob, token id, text or None] per token),
  "output_top_logprobs", "input_token_logprobs" / "input_top_logprobs" (from
  `logprob_start_len`), "routed_experts" (base64 int32, with "routed_experts_start_len")}}`; a
  list for a batch or `n > 1` (prompt-major). Streaming sends the cumulative answer per event
  (its spans too; routes and prompt log-probs with the final one), then `data: [DONE]`.
  `lora_path` (one, or one per prompt) selects a LoRA adapter loaded with `/load_lora_adapter`
  (by its name or the path it was loaded from). `image_data` (a text model: null only) and
  `custom_params` are refused by name.
* `/pause_generation` modes map to ours: `abort` -> ABORT, `retract` -> RETRACT (KV freed,
  requests requeued: `flush_cache` succeeds), `in_place` -> KEEP (requests keep their KV:
  `flush_cache` is refused while they hold it, as in SGLang).
* `weight_version` is our policy version as a string; `update_weights_*` may set it
  (`"7"`, `"v7"`, `"step_7"`). The weight routes run `rollout.http.core.weights` (weight sync's mapping
  of SGLang's calls, over the front's client): `/init_weights_update_group`,
  `/update_weights_from_distributed` (one broadcast per tensor, committed once the model is
  complete), `/update_weights_from_tensor` (our shared-memory handle, never pickle),
  `/destroy_weights_update_group`. `/get_server_info` (and `/server_info`, shared with vLLM's) and
  `/v1/loads` report the engine in SGLang's names.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from inference import FinishReason, PauseMode, SamplingParams, SuspendPolicy
from inference.core.states import MemoryTag
from rollout.http.core import structured
from rollout.http.core.disconnects import unless_disconnected
from rollout.http.core.errors import APIError, engine_call, from_exception
from rollout.http.core.front import HttpFront
from rollout.http.core.generation import GenSpec, Sample, version_spans
from rollout.http.core.logprobs import ranked as top_entries
from rollout.http.core.responses import front_of, json_response, sse
from rollout.http.core.sampling import sampling_params
from rollout.http.core.schemas import (
    AbortReq,
    DestroyWeightsUpdateGroupReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    MemoryOccupationReqInput,
    PauseGenerationReqInput,
    SGLangSampling,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)

SGLANG_API_VERSION = "0.5.6"
router = APIRouter()
# NOTE: SGLang takes GET for these control calls too; `rollout.http.core.guards` holds such a GET to the POST rule
STATE_CHANGING_GETS = frozenset({"/flush_cache", "/release_memory_occupation", "/resume_memory_occupation"})
PAUSE_MODES = {"abort": PauseMode.ABORT, "retract": PauseMode.RETRACT, "in_place": PauseMode.KEEP}
FLUSH_MESSAGE = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                 "requests, the operation will not be performed.)\n")


# ---- /generate -----------------------------------------------------------------------------------


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateReqInput, request: Request) -> Response:
    front = front_of(request)
    batched = isinstance(body.text, list) or (body.input_ids is not None and isinstance(body.input_ids[0], list))
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = [await front.encode(t) for t in texts]
    else:
        prompts = [list(p) for p in body.input_ids] if batched else [list(body.input_ids)]
    if not all(prompts):
        raise APIError(400, "The input must not be empty.")
    front.check_ids(prompts, "input_ids")
    sampling = _per_prompt(body.sampling_params, len(prompts), "sampling_params") or [SGLangSampling()] * len(prompts)
    rids = _rids(body.rid, len(prompts))
    for name in ("return_logprob", "top_logprobs_num", "logprob_start_len", "extra_key", "lora_path"):
        _per_prompt(getattr(body, name), len(prompts), name)
    logprob = [bool(_at(body.return_logprob, i)) for i in range(len(prompts))]
    starts = [_input_start(_at(body.logprob_start_len, i), len(p)) if logprob[i] else -1
              for i, p in enumerate(prompts)]
    specs = []
    for i, (prompt, sp) in enumerate(zip(prompts, sampling)):
        top = _at(body.top_logprobs_num, i) or 0
        max_tokens = front.completion_budget([prompt], sp.max_new_tokens, "input")
        params = _sampling(front, sp, max_tokens, top, prompt_top=top if starts[i] >= 0 else None,
                           salt=_at(body.extra_key, i), routes=body.return_routed_experts)
        params = _with_lora(front, params, _at(body.lora_path, i))
        specs.append(GenSpec([prompt], sp.n, params, stops=sp.stop_strings(), include_stop=sp.no_stop_trim,
                             skip_special_tokens=sp.skip_special_tokens, stream=body.stream, rid=rids[i],
                             input_logprobs_from=starts[i]))
    if body.stream:
        return StreamingResponse(_events(front, body, specs, logprob), media_type="text/event-stream")
    gens = [front.generation(spec) for spec in specs]
    results = await unless_disconnected(request, asyncio.gather(*(g.run() for g in gens)))  # run together
    version = await _version(front, [s for samples in results for s in samples])
    outputs = [_answer(front, body, gen.spec, s, gen.seconds, want, version)
               for gen, samples, want in zip(gens, results, logprob) for s in samples]
    return json_response(outputs if batched or len(outputs) > 1 else outputs[0])


async def _events(front: HttpFront, body: GenerateReqInput, specs: list[GenSpec], logprob: list[bool]
                  ) -> AsyncIterator[bytes]:
    try:  # NOTE: a streamed batch runs prompt after prompt (SGLang interleaves them; the data is the same)
        for k, (spec, want) in enumerate(zip(specs, logprob)):
            gen = front.generation(spec)
            async for d in gen.deltas():
                s = d.sample
                version = str(max(s.versions)) if s.versions else None
                out = _answer(front, body, spec, s, time.perf_counter() - gen.started, want, version,
                              final=d.finish_reason is not None, upto=d.start + len(d.ids))
                out["index"] = k * spec.n + s.index
                yield sse(out)
    except Exception as exc:  # noqa: BLE001 (headers are sent: the error goes into the stream)
        yield sse({"error": {"message": from_exception(exc).message}})
    yield b"data: [DONE]\n\n"


def _answer(front: HttpFront, body: GenerateReqInput, spec: GenSpec, s: Sample, seconds: float, logprob: bool,
            version: Optional[str], *, final: bool = True, upto: Optional[int] = None) -> dict[str, Any]:
    ids = s.ids if upto is None else s.ids[:upto]
    text = s.text if final else front.codec.decode(ids, skip_special_tokens=spec.skip_special_tokens)
    meta: dict[str, Any] = {"id": spec.rid if spec.n == 1 else f"{spec.rid}-{s.index}",
                            "finish_reason": _finish_reason(s, spec) if final else None,
                            "prompt_tokens": len(spec.prompts[0]), "completion_tokens": len(ids),
                            "weight_version": version, "e2e_latency": seconds,
                            "weight_versions": version_spans(s.versions[:len(ids)]),
                            "cached_tokens": s.cached_tokens}
    if final and s.routed_experts is not None:
        meta.update(routed_experts_meta(s.routed_experts))
    if logprob and spec.input_logprobs_from >= 0 and final:
        meta.update(_input_logprobs(front, spec, s, body.return_text_in_logprobs))
    if logprob:
        with_text = body.return_text_in_logprobs
        meta["output_token_logprobs"] = [
            [lp, t, front.token_text(t, False) if with_text else None] for lp, t in zip(s.logprobs, ids)]
        if spec.top_logprobs:
            meta["output_top_logprobs"] = [
                [[lp, t, front.token_text(t, False) if with_text else None]
                 for t, lp in top_entries(s.top_logprobs[j] if s.top_logprobs else None, spec.top_logprobs)]
                for j in range(len(ids))]
    return {"text": text, "output_ids": ids, "meta_info": meta}


def routed_experts_meta(routes: Any) -> dict[str, Any]:
    """SGLang's `routed_experts`: the int32 expert ids `[positions fed, moe layers * k]` (every prompt
    and completion token but the last, which is never fed), little-endian bytes in base64, as AReaL
    and slime decode them; `routed_experts_start_len` 0: all of them."""
    data = np.ascontiguousarray(routes, dtype="<i4").tobytes()
    return {"routed_experts": base64.b64encode(data).decode(), "routed_experts_start_len": 0}


def _input_start(start: Optional[int], length: int) -> int:
    """SGLang's `logprob_start_len`: -1 (or none) no prompt log-probs, else from that position on."""
    if start is None or start == -1:
        return -1
    if not 0 <= start < length:
        raise APIError(400, f"logprob_start_len ({start}) must be -1 or in [0, {length}) for an input of {length} "
                            "tokens", param="logprob_start_len")
    return start


def _input_logprobs(front: HttpFront, spec: GenSpec, s: Sample, with_text: bool) -> dict[str, Any]:
    """`input_token_logprobs` (`[logprob, id, text]`, None for the first token, which nothing
    predicts) and `input_top_logprobs` from `logprob_start_len` on, as SGLang answers them."""
    prompt, rows = spec.prompts[0], s.prompt_logprobs or [None] * len(spec.prompts[0])
    text = (lambda t: front.token_text(t, False)) if with_text else (lambda t: None)
    positions = range(spec.input_logprobs_from, len(prompt))
    out: dict[str, Any] = {"input_token_logprobs": [
        [None if p == 0 or rows[p] is None else rows[p].get(prompt[p]), prompt[p], text(prompt[p])] for p in positions]}
    if spec.top_logprobs:
        def top(p: int) -> Optional[list]:
            return None if p == 0 or rows[p] is None else [[lp, t, text(t)]
                                                           for t, lp in top_entries(rows[p], spec.top_logprobs)]
        out["input_top_logprobs"] = [top(p) for p in positions]
    return out


def _finish_reason(s: Sample, spec: GenSpec) -> Optional[dict[str, Any]]:
    if s.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": spec.sampling.max_tokens}
    if s.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": s.matched}
    if s.finish_reason is FinishReason.ABORT:
        return {"type": "abort", "message": "aborted"}
    if s.finish_reason is FinishReason.STALE:
        return {"type": "abort", "message": "stale: started more than max_staleness policy versions ago"}
    return None


async def _version(front: HttpFront, samples: list[Sample]) -> str:
    versions = [v for s in samples for v in s.versions]
    return str(max(versions)) if versions else str(await front.policy_version())


def _sampling(front: HttpFront, sp: SGLangSampling, max_tokens: int, top: int, prompt_top: Optional[int] = None,
              salt: Optional[str] = None, routes: bool = False) -> SamplingParams:
    """SGLang's names onto the OpenAI body's (`rollout.http.core.sampling` maps those to the engine's);
    `extra_key` is the engine's `cache_salt` (different keys never share a cached block)."""
    body = SimpleNamespace(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
                           seed=sp.sampling_seed, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
                           repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
                           frequency_penalty=sp.frequency_penalty, min_tokens=sp.min_new_tokens, cache_salt=salt,
                           logit_bias=sp.logit_bias, bad_words=None, allowed_token_ids=None, logprobs_mode=None)
    params = sampling_params(front.codec, body, n=sp.n, max_tokens=max_tokens, logprobs=top,
                             prompt_logprobs=prompt_top, structured=structured.from_sglang(sp),
                             **front.logprob_rules())
    return dataclasses.replace(params, return_routed_experts=True) if routes else params


def _with_lora(front: HttpFront, params: SamplingParams, lora: Optional[str]) -> SamplingParams:
    """SGLang's `lora_path` names a loaded adapter, by its name or the path it was loaded from."""
    if lora is None:
        return params
    by_path = {path: name for name, path in front.loras.items()}
    name = lora if lora in front.loras else by_path.get(lora)
    if name is None:
        raise APIError(400, f"lora_path: no LoRA adapter {lora!r} is loaded (load it with /load_lora_adapter)",
                       param="lora_path")
    return dataclasses.replace(params, lora_name=name)


def _per_prompt(value: Any, count: int, name: str) -> Optional[list]:
    if isinstance(value, list):
        if len(value) != count:
            raise APIError(400, f"{name}: a list must have one entry per prompt ({count}), got {len(value)}")
        return value
    return None if value is None else [value] * count


def _at(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, list) else value


def _rids(rid: Any, count: int) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    rids = _per_prompt(rid, count, "rid")
    if count > 1 and not isinstance(rid, list):
        rids = [f"{rid}-{i}" for i in range(count)]
    return rids


# ---- control -------------------------------------------------------------------------------------


@router.post("/abort_request")
async def abort_request(body: AbortReq, request: Request) -> Response:
    front = front_of(request)
    await front.abort_where(lambda rid: body.abort_all or rid == body.rid or rid.startswith(f"{body.rid}-"))
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    body = await _optional(request, PauseGenerationReqInput)
    await engine_call(front_of(request).client.pause(PAUSE_MODES[body.mode]))
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    await engine_call(front_of(request).client.continue_())
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """Refused (400) while requests hold KV blocks (running, or paused in place), as SGLang does."""
    client = front_of(request).client
    stats = await engine_call(client.stats())
    if float(stats.get("kv_utilization", 0.0) or 0.0) > 0.0:
        return Response(FLUSH_MESSAGE, status_code=400, media_type="text/plain")
    await engine_call(client.reset_prefix_cache())
    return Response(FLUSH_MESSAGE, status_code=200, media_type="text/plain")


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request) -> Response:
    """`tags` (none: all): each part freed once (`cuda_graph` goes with the KV cache, whose step
    workspaces hold the graphs); the weights are kept on host."""
    body = await _optional(request, MemoryOccupationReqInput)
    await _memory_call(front_of(request).client.suspend(SuspendPolicy.RECOMPUTE, tags=_memory_parts(body.tags)))
    return json_response(None)  # NOTE: SGLang's handler returns nothing: JSON null, which slime reads (.json())


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request) -> Response:
    """`tags` (none: all that sleeps; SGLang's 400 when nothing does): each part woken once, one
    awake already left as it is (slime wakes the weights, loads them, then the KV cache)."""
    body = await _optional(request, MemoryOccupationReqInput)
    client = front_of(request).client
    await _memory_call(client.resume(tags=None if body.tags is None else _memory_parts(body.tags)))
    return json_response(None)


def _memory_parts(tags: Optional[list[str]]) -> list[MemoryTag]:
    if tags is None:
        return list(MemoryTag)
    # NOTE: SGLang's cuda_graph tag: the graphs live in the step workspaces, which sleep with the KV cache
    return sorted({MemoryTag.KV_CACHE if t == "cuda_graph" else MemoryTag(t) for t in tags})


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> Response:
    return json_response({"weight_version": str(await engine_call(front_of(request).policy_version()))})


@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    front = front_of(request)
    return json_response({"model_path": front.config.model_path or front.config.model_name,
                          "tokenizer_path": front.config.model_path or front.config.model_name,
                          "is_generation": True, "preferred_sampling_params": None,
                          "weight_version": str(await engine_call(front.policy_version())),
                          "has_image_understanding": False, "has_audio_understanding": False})


def server_args(front: HttpFront, stats: dict[str, Any]) -> dict[str, Any]:
    """SGLang's `/get_server_info` answer: its server-args names for what this engine is (one
    worker per engine: tp, pp, ep 1; a router's replicas as dp), the engine's stats as
    `internal_states`, and this front's session counters. slime reads the parallel sizes,
    `disaggregation_mode` and `encoder_only` to place external engines
    (slime/backends/sglang_utils/external.py)."""
    cfg, sessions = front.config, front.sessions
    return {
        "model_path": cfg.model_path or cfg.model_name, "tokenizer_path": cfg.model_path or cfg.model_name,
        "served_model_name": cfg.model_name, "context_length": cfg.max_model_len, "max_model_len": cfg.max_model_len,
        "dtype": str(stats.get("engine/dtype")), "page_size": stats.get("engine/block_size"),
        "max_running_requests": stats.get("engine/max_requests"),
        "tp_size": 1, "pp_size": 1, "ep_size": 1, "moe_dp_size": 1, "dp_size": int(stats.get("replicas_up", 1)),
        "disaggregation_mode": "null", "encoder_only": False,
        "enable_lora": bool(stats.get("engine/max_loras")), "max_loras_per_batch": stats.get("engine/max_loras"),
        "max_lora_rank": stats.get("engine/max_lora_rank"),
        "weight_version": str(stats.get("policy_version")), "version": SGLANG_API_VERSION,
        "sglang_api_version": SGLANG_API_VERSION, "internal_states": [stats],
        "sessions": {"open": len(sessions), "continued": sessions.continued, "restarted": sessions.restarts},
    }


@router.get("/v1/loads")
async def loads(request: Request) -> Response:
    """SGLang's load report, as its gateway polls it: one entry per engine (behind our router, the
    fleet's sums as one; its replicas' own are in `/get_server_info`'s `internal_states`)."""
    stats = await engine_call(front_of(request).client.stats())
    total = int(stats.get("engine/total_blocks") or 0) * int(stats.get("engine/block_size") or 0)
    return json_response({"loads": [{
        "dp_rank": 0, "num_running_reqs": int(stats.get("engine/active_request_count", 0) or 0),
        "num_waiting_reqs": int(stats.get("engine/waiting", 0) or 0),
        "token_usage": float(stats.get("kv_utilization", 0.0) or 0.0), "max_total_num_tokens": total,
        "weight_version": str(stats.get("policy_version"))}]})


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    front = front_of(request)
    return json_response(server_args(front, await engine_call(front.client.stats())))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightFromDiskReqInput, request: Request) -> Response:
    """A safetensors directory the engine can read; `weight_version` sets the new version ("7", "v7")."""
    front = front_of(request)
    return await _weights(front, "update", front.client.update_weights_from_disk, body.model_path,
                          body.load_format, body.abort_all_requests, body.weight_version, timeout=front.timeout)


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitWeightsUpdateGroupReqInput, request: Request) -> Response:
    """Join the trainer's group (it is rank 0 at master_address:master_port); returns once joined."""
    front = front_of(request)
    return await _weights(front, "init", front.client.init_weights_update_group, body.master_address,
                          body.master_port, body.rank_offset, body.world_size, body.group_name, body.backend,
                          timeout=front.timeout)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateWeightsFromDistributedReqInput, request: Request) -> Response:
    """Receive the named tensors the trainer broadcasts over the group, one broadcast per tensor in
    order (SGLang's way); the update commits once the model is complete."""
    front = front_of(request)
    return await _weights(front, "distributed", front.client.update_weights_from_distributed, body.names,
                          body.dtypes, body.shapes, body.group_name, body.flush_cache, body.abort_all_requests,
                          body.weight_version, body.load_format, timeout=front.timeout)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: UpdateWeightsFromTensorReqInput, request: Request) -> Response:
    """Tensors in shared memory on this host, named by our msgpack handle (`weight_sync.tensor_payload`);
    a pickled payload, what slime and verl send SGLang, is refused naming that handle, never unpickled."""
    front = front_of(request)
    return await _weights(front, "update", front.client.update_weights_from_tensor, body.serialized_named_tensors,
                          body.load_format, body.flush_cache, body.abort_all_requests, body.weight_version,
                          timeout=front.timeout)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupReqInput, request: Request) -> Response:
    front = front_of(request)
    return await _weights(front, "destroy", front.client.destroy_weights_update_group, body.group_name,
                          timeout=front.timeout)


WEIGHT_MESSAGES = {"update": "Succeeded to update model weights.", "init": "Succeeded to initialize custom process "
                   "group.", "distributed": "Succeeded to update parameter online.",
                   "destroy": "Succeeded to destroy custom process group."}


async def _weights(front: HttpFront, what: str, call: Any, *args: Any, **kwargs: Any) -> Response:
    """Await a weight call: SGLang's `{"success", "message"}`, 200 or 400."""
    try:
        value = await call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 (SGLang answers a failed update with success false)
        body: dict[str, Any] = {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        if what == "update":
            body["num_paused_requests"] = 0
        return json_response(body, status=400)
    message = WEIGHT_MESSAGES[what]
    if what in ("update", "distributed") and value is not None:
        message += f" Weight version is {value}."
    body = {"success": True, "message": message}
    if what == "update":
        body["num_paused_requests"] = 0
    return json_response(body)


@router.get("/health")
async def health(request: Request) -> Response:
    try:
        info = await front_of(request).client.health(timeout=20.0)
    except Exception:  # noqa: BLE001 (no answer is unhealthy)
        return Response(status_code=503)
    if info.serving_error is not None:  # NOTE: alive (200, as vLLM's), but say why it refuses to generate
        return json_response({"status": "not_generating", "generating": False, "reason": info.serving_error},
                             status=200 if info.healthy else 503)
    return Response(status_code=200 if info.healthy else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy when one token comes back within 20 s (SGLang's HEALTH_CHECK_TIMEOUT)."""
    front = front_of(request)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        await front.client.generate([[0]], 1, params, timeout=20.0)
    except Exception:  # noqa: BLE001
        return Response(status_code=503)
    return Response(status_code=200)


async def _memory_call(awaitable: Any) -> Any:
    """SGLang answers a release or resume the engine's state refuses (resume while running, release
    while released) with its handler's 400, not the 503 of a generation the engine cannot serve now."""
    try:
        return await awaitable
    except Exception as exc:  # noqa: BLE001
        err = from_exception(exc)
        raise (APIError(400, err.message) if err.status == 503 else err) from exc


async def _optional(request: Request, model: Any) -> Any:
    raw = await request.body()
    try:
        return model.model_validate_json(raw) if raw.strip() else model()
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
