"""LoRA adapter routes: vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, SGLang's
`/load_lora_adapter` and `/unload_lora_adapter`, in their bodies and answers.

* vLLM (TRL's and verl's calls): `{"lora_name", "lora_path", "load_inplace"}` -> 200 and
  `Success: LoRA adapter '{name}' added successfully.` (text); a name already loaded is a 400
  unless `load_inplace` (then it is the adapter's next version: requests in flight finish on the
  one they started with, new ones take the new one, and no block of the old version is reused).
  `{"lora_name"}` -> `Success: LoRA adapter '{name}' removed successfully.`; an unknown name 404,
  an adapter still used by requests in flight 400.
* SGLang: the same bodies -> `{"success", "error_message", "loaded_adapters": {name: path}}`
  (a refusal: 400 with `success` false and the reason).

A bad adapter (no such directory, missing files, wrong shapes or target modules, past `max_loras`
or `max_lora_rank`) is refused with the engine's reason and changes nothing. Once loaded, a
request selects the adapter by `model` (OpenAI, vLLM) and `/v1/models` lists it with `parent`.
"""

from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import Field

from rollout.http.core.errors import APIError, engine_call
from rollout.http.core.front import HttpFront
from rollout.http.core.responses import front_of
from rollout.http.core.schemas import Strict

router = APIRouter()
LoraName = Annotated[str, Field(min_length=1, max_length=256)]


class LoadLoraAdapter(Strict):
    lora_name: LoraName
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of that name (here: its next version)
    pinned: bool = False  # SGLang's: never evicted (adapters are never evicted here)


class UnloadLoraAdapter(Strict):
    lora_name: LoraName
    lora_int_id: Optional[int] = None  # vLLM's, unused: adapters are known by name


async def _load(front: HttpFront, body: LoadLoraAdapter) -> None:
    if front.model_names.count(body.lora_name):
        raise APIError(400, f"The lora adapter '{body.lora_name}' has the name of the base model.",
                       param="lora_name")
    async with front.lora_changes:
        await _load_one(front, body)


async def _load_one(front: HttpFront, body: LoadLoraAdapter) -> None:
    await front.refresh_loras()
    if body.lora_name in front.loras and not body.load_inplace:
        raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded. If you want to "
                            "load it in place, set load_inplace=true.", param="lora_name")
    await engine_call(front.client.load_lora(body.lora_name, body.lora_path, timeout=front.timeout))
    await front.refresh_loras()


async def _unload(front: HttpFront, body: UnloadLoraAdapter) -> None:
    async with front.lora_changes:
        try:
            await engine_call(front.client.unload_lora(body.lora_name, timeout=front.timeout))
        finally:
            await front.refresh_loras()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapter, request: Request) -> Response:
    await _load(front_of(request), body)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> Response:
    await _unload(front_of(request), body)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _sglang_answer(front: HttpFront, error: Optional[APIError] = None) -> JSONResponse:
    body = {"success": error is None, "error_message": "" if error is None else error.message,
            "loaded_adapters": dict(front.loras)}
    return JSONResponse(body, status_code=200 if error is None else error.status)


@router.post("/load_lora_adapter")
async def sglang_load_lora_adapter(body: LoadLoraAdapter, request: Request) -> Response:
    front = front_of(request)
    try:
        await _load(front, body.model_copy(update={"load_inplace": True}))  # NOTE: SGLang has no in-place flag
    except APIError as exc:
        return _sglang_answer(front, exc)
    return _sglang_answer(front)


@router.post("/unload_lora_adapter")
async def sglang_unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> Response:
    front = front_of(request)
    try:
        await _unload(front, body)
    except APIError as exc:
        return _sglang_answer(front, exc)
    return _sglang_answer(front)
