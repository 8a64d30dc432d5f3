"""vLLM's text routes that generate nothing: `/tokenize`, `/detokenize`, `/tokenizer_info`,
`/v1/chat/completions/render`.

* `/tokenize` takes a `prompt` (encoded with `add_special_tokens`, default true) or chat
  `messages` (rendered as the chat route renders them, `add_special_tokens` default false) and
  answers `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` only with
  `return_token_strs`).
* `/detokenize` takes `tokens` and answers `{"prompt"}`.
* `/tokenizer_info` answers the tokenizer's configuration, as `tokenizer_config.json` holds it:
  `tokenizer_class` and the tokenizer's init arguments (the chat template among them).
* `/v1/chat/completions/render` takes a chat completion's body and answers vLLM's
  `[conversation, engine_prompts]`: the messages as the template saw them, and one
  `{"prompt", "prompt_token_ids"}`, the prompt the chat route would run (no session continued).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Optional, Union

from fastapi import APIRouter, Request, Response
from pydantic import Field

from rollout.http.errors import APIError
from rollout.http.openai_routes import front_of, json_response
from rollout.http.schemas import ChatCompletionRequest, ChatMessage, Strict
from rollout.http.sessions import Render
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
    return json_response({"prompt": front.codec.decode(body.tokens, skip_special_tokens=False)})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    tokenizer = front_of(request).codec.tokenizer
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
    front.check_model(body.model)
    messages = [m.as_template_dict() for m in body.messages]
    render = Render(body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)
    ids, _ = await front.chat_prompt(None, messages, body.tools, render)
    return json_response([messages, [{"prompt": front.codec.decode(ids, skip_special_tokens=False),
                                      "prompt_token_ids": ids}]])
