"""vLLM's text routes that generate nothing: `/tokenize`, `/detokenize`, `/tokenizer_info`,
`/v1/chat/completions/render`.

* `/tokenize` takes a `prompt` (encoded with `add_special_tokens`, default true) or chat
  `messages` (rendered as the chat route renders them, `add_special_tokens` default false) and
  answers `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` only with
  `return_token_strs`).
* `/detokenize` takes `tokens` and answers `{"prompt"}`.
* `/tokenizer_info` answers the tokenizer's configuration, as `tokenizer_config.json` holds it:
  `tokenizer_class` and the tokenizer's init arguments (the chat template among them).
* `/v1/chat/completions/render` takes a chat completion's body and answers what vLLM (0.22) answers:
  the token-in request it would run, `{"request_id", "token_ids", "features", "sampling_params",
  "model", "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params"}`, ready to
  post to `/inference/v1/generate` (the prompt the chat route would run; no session continued).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated, Any, Optional, Union

from fastapi import APIRouter, Request, Response
from pydantic import Field

from rollout.http.core.errors import APIError
from rollout.http.core.responses import front_of, json_response
from rollout.http.core.schemas import ChatCompletionRequest, ChatMessage, Strict
from rollout.http.core.sessions import Render
from rollout.text import ChatTemplateError, PromptTooLongError

router = APIRouter()


class TokenizeCompletionRequest(Strict):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Strict):
    model: Optional[str] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None


class DetokenizeRequest(Strict):
    model: Optional[str] = None
    tokens: list[Annotated[int, Field(ge=0)]]


@router.post("/tokenize")
async def tokenize(body: Union[TokenizeCompletionRequest, TokenizeChatRequest], request: Request) -> Response:
    front = front_of(request)
    front.check_model(body.model)
    codec = front.codec
    try:
        if isinstance(body, TokenizeChatRequest):
            if body.continue_final_message and body.add_generation_prompt:
                raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                               param="continue_final_message")
            text = await asyncio.to_thread(codec.render, [m.as_template_dict() for m in body.messages],
                                           add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                                           continue_final_message=body.continue_final_message,
                                           template_kwargs=body.chat_template_kwargs)
        else:
            text = body.prompt
        ids = await asyncio.to_thread(codec.encode, text, add_special_tokens=body.add_special_tokens)
    except (ChatTemplateError, PromptTooLongError) as exc:
        raise APIError(400, str(exc), param="messages" if isinstance(body, TokenizeChatRequest) else "prompt") from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": front.config.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = codec.tokenizer.convert_ids_to_tokens(ids)
    return json_response(out)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    front = front_of(request)
    front.check_model(body.model)
    front.check_ids([body.tokens], "tokens")
    if not front.codec.has_text:
        raise front.codec.refuse("/detokenize")
    return json_response({"prompt": front.codec.decode(body.tokens, skip_special_tokens=False)})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    codec = front_of(request).codec
    if not codec.has_text:
        raise codec.refuse("/tokenizer_info")
    tokenizer = codec.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for key, value in getattr(tokenizer, "init_kwargs", {}).items():
        if hasattr(value, "content"):  # an AddedToken: its text
            value = str(value.content)
        if key == "added_tokens_decoder":
            value = {str(i): {"content": str(t), "special": bool(getattr(t, "special", False))}
                     for i, t in value.items()}
        if _plain(value):
            info[key] = value
    if getattr(tokenizer, "chat_template", None):
        info["chat_template"] = tokenizer.chat_template
    return json_response(info)


def _plain(value: Any) -> bool:
    """Whether `value` is JSON as it is (a tokenizer's init arguments also hold objects and paths)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, request: Request) -> Response:
    front = front_of(request)
    model = front.check_model(body.model)
    messages = [m.as_template_dict() for m in body.messages]
    render = Render(body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)
    ids, _ = await front.chat_prompt(None, messages, body.tools, render)
    return json_response({"request_id": f"chatcmpl-{uuid.uuid4().hex}", "token_ids": ids, "features": None,
                          "sampling_params": _generate_sampling(body), "model": model, "stream": body.stream,
                          "stream_options": None, "cache_salt": body.cache_salt, "priority": 0,
                          "kv_transfer_params": None})


# a chat body's field -> its name in vLLM's SamplingParams, when both are set and not at their neutral values
_CARRIED = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "bad_words",
            "allowed_token_ids", "prompt_logprobs", "skip_special_tokens", "include_stop_str_in_output",
            "logprobs_mode")


def _generate_sampling(body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat body's sampling as `/inference/v1/generate` takes it (vLLM's field names)."""
    out: dict[str, Any] = {name: getattr(body, name) for name in _CARRIED if getattr(body, name) is not None}
    if body.completion_limit() is not None:
        out["max_tokens"] = body.completion_limit()
    if body.stop is not None:
        out["stop"] = body.stop
    if body.logprobs:
        out["logprobs"] = body.top_logprobs or 0
    if body.structured_outputs is not None:
        out["structured_outputs"] = body.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
    return out
