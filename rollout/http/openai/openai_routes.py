"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Responses follow OpenAI's shapes; each choice also carries the exact ids under vLLM's names for
`return_token_ids` (vLLM >= 0.10.2): `prompt_token_ids` and `token_ids` on every completion
choice; `prompt_token_ids` on a chat response (and on each of its choices) and `token_ids` on each
chat choice; beside them, ours, `weight_versions` (`[{"version", "start", "end"}]`: the policy
version of each span of those tokens). Streaming is Server-Sent Events (`data: {chunk}` ...
`data: [DONE]`); the first chunk of a choice carries its `prompt_token_ids`, every chunk the
`token_ids` it adds and their `weight_versions`. Log-probs are the
engine's raw ones (log-softmax of the logits at temperature 1), what a trainer recomputes; their
shapes (`echo`, vLLM's `prompt_logprobs`, the sampled token in every top list) are in
`rollout.http.core.logprobs`.

`best_of` (completions, not streamed) samples `best_of` of each prompt and answers the `n` with
the highest cumulative log-prob, vLLM's rule. `echo` with `max_tokens: 0` scores the prompt only:
the engine samples one token (it always samples one), which is dropped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from inference import FinishReason, StructuredOutputs
from rollout.http.core import structured
from rollout.http.core.disconnects import unless_disconnected
from rollout.http.core.errors import APIError, from_exception
from rollout.http.core.front import HttpFront
from rollout.http.core.generation import Delta, Generation, GenSpec, Sample, version_spans
from rollout.http.core.logprobs import chat_top, completion_top, echoed_prompt, prompt_entries
from rollout.http.core.responses import front_of, json_response, sse
from rollout.http.core.schemas import ChatCompletionRequest, CompletionRequest
from rollout.http.core.sessions import Render, Reply, calls_of
from rollout.http.core.tools import ForcedCallError, ToolChoiceError, ToolPlan, plan_tools

router = APIRouter()
SESSION_HEADER = "X-Session-ID"


MODELS_ENGINE_WAIT_S = 2.0  # how long /v1/models waits for the engine's list of adapters


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """The served names, then each loaded LoRA adapter with its `parent` (vLLM's cards)."""
    front = front_of(request)
    cards = [{"id": name, "object": "model", "created": front.created, "owned_by": "rollout-engine",
              "root": front.config.model_path or front.config.model_name, "max_model_len": front.config.max_model_len}
             for name in front.model_names]
    try:
        loras = [(i.name, i.path, {"version": i.version, "rank": i.rank})
                 for i in await front.refresh_loras(timeout=MODELS_ENGINE_WAIT_S)]
    except Exception:  # noqa: BLE001 (an engine down or slow: the names last heard, as /v1/models never fails)
        loras = [(name, path, {}) for name, path in front.loras.items()]
    for name, path, extra in loras:
        cards.append({"id": name, "object": "model", "created": front.created, "owned_by": "rollout-engine",
                      "root": path, "parent": front.config.model_name, "max_model_len": front.config.max_model_len,
                      **extra})
    return json_response({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> Response:
    front = front_of(request)
    front.check_model(model)
    return json_response({"id": model, "object": "model", "created": front.created, "owned_by": "rollout-engine"})


# ---- completions ---------------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    front = front_of(request)
    body.model = front.check_model(body.model)
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [await front.encode(prompt)]
    elif isinstance(prompt[0], str):
        prompts = [await front.encode(p) for p in prompt]
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if not all(prompts):
        raise APIError(400, "The prompt must not be empty (it tokenized to no tokens).", param="prompt")
    front.check_ids(prompts)
    score_only = body.echo and body.max_tokens == 0
    max_tokens = front.completion_budget(prompts, 1 if score_only else body.max_tokens, "prompt",
                                         defaulted=not score_only)
    echo_top = body.logprobs if body.echo and body.logprobs is not None else None
    scored = max((k for k in (body.prompt_logprobs, echo_top) if k is not None), default=None)
    spec = _spec(front, body, prompts, max_tokens, body.logprobs, n=body.best_of or body.n, prompt_logprobs=scored)
    spec.whole = score_only
    gen = front.generation(spec)
    rid = f"cmpl-{spec.rid}"
    if body.stream:
        return _stream(gen, _completion_chunks(front, body, gen, rid, score_only))
    samples = _best(await unless_disconnected(request, gen.run()), body.n)
    choices = []
    for i, s in enumerate(samples):
        if score_only:
            s.truncate()
        choice = {"index": i, "text": s.text, "logprobs": _completion_logprobs(front, body, s, 0, s.ids),
                  "finish_reason": s.finish_reason, "stop_reason": _stop_reason(s)}
        if body.echo:
            choice["text"] = _prompt_text(front, body, prompts, s.group) + s.text
            if choice["logprobs"] is not None:
                choice["logprobs"] = _echoed(front, body, prompts[s.group], s, choice["logprobs"])
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _prompt_logprobs(front, body, prompts[s.group], s, body.prompt_logprobs)
        if body.return_token_ids is not False:
            choice["prompt_token_ids"] = prompts[s.group]
            choice["token_ids"] = s.ids
            choice["weight_versions"] = version_spans(s.versions)
        choices.append(choice)
    return json_response({"id": rid, "object": "text_completion", "created": int(time.time()), "model": body.model,
                          "choices": choices, "usage": _usage(prompts, samples)})


def _best(samples: list[Sample], n: int) -> list[Sample]:
    """Each prompt's `n` samples of the highest cumulative log-prob (all of them when `best_of` was not asked)."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    if all(len(g) == n for g in groups.values()):
        return samples
    return [s for g in sorted(groups) for s in sorted(groups[g], key=lambda s: -sum(s.logprobs))[:n]]


def _prompt_text(front: HttpFront, body: CompletionRequest, prompts: list[list[int]], group: int) -> str:
    """The echoed prompt: the text sent, or the ids sent decoded."""
    if isinstance(body.prompt, str):
        return body.prompt
    if isinstance(body.prompt[0], str):
        return str(body.prompt[group])
    return front.codec.decode(prompts[group], skip_special_tokens=body.skip_special_tokens)


def _echoed(front: HttpFront, body: CompletionRequest, prompt: list[int], s: Sample, completion: dict) -> dict:
    as_ids = front.tokens_as_ids(body)
    tokens, lps, tops = echoed_prompt(prompt, s.prompt_logprobs, body.logprobs or 0,
                                      lambda t: front.token_text(t, as_ids))
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens + completion["tokens"], "token_logprobs": lps + completion["token_logprobs"],
            "top_logprobs": tops + (completion["top_logprobs"] or []),
            "text_offset": offsets + [at + o for o in completion["text_offset"]]}


def _prompt_logprobs(front: HttpFront, body: Any, prompt: list[int], s: Sample, k: int) -> Optional[list]:
    as_ids = front.tokens_as_ids(body)
    return prompt_entries(prompt, s.prompt_logprobs, k, lambda t: front.token_text(t, as_ids), s.prompt_ranks)


async def _completion_chunks(front: HttpFront, body: CompletionRequest, gen: Generation, rid: str,
                             score_only: bool = False) -> AsyncIterator[bytes]:
    """Each choice's deltas; with `echo`, its first one starts with the prompt (NOTE: echo streams each
    sample whole, in one delta, when it asks for log-probs: the prompt's come with the final output)."""
    created, first = int(time.time()), set()
    async for d in gen.deltas():
        s = d.sample
        if score_only:
            s.truncate()
            d.text, d.ids, d.finish_reason = "", [], FinishReason.LENGTH
        choice = {"index": _index(gen, s), "text": d.text,
                  "logprobs": _completion_logprobs(front, body, s, d.start, d.ids),
                  "finish_reason": d.finish_reason}
        opening = choice["index"] not in first
        first.add(choice["index"])
        if body.echo and opening:
            choice["text"] = _prompt_text(front, body, gen.spec.prompts, s.group) + d.text
            if choice["logprobs"] is not None:
                choice["logprobs"] = _echoed(front, body, gen.spec.prompts[s.group], s, choice["logprobs"])
        if body.return_token_ids is not False:
            if opening:
                choice["prompt_token_ids"] = gen.spec.prompts[s.group]
            choice["token_ids"] = d.ids
            choice["weight_versions"] = version_spans(s.versions[d.start:d.start + len(d.ids)], d.start)
        chunk = {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                 "choices": [choice]}
        if _continuous_usage(body):
            chunk["usage"] = _usage(gen.spec.prompts, gen.samples)
        yield sse(chunk)
    if body.stream_options is not None and body.stream_options.include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": body.model, "choices": [],
                   "usage": _usage(gen.spec.prompts, gen.samples)})


def _completion_logprobs(front: HttpFront, body: CompletionRequest, s: Sample, start: int, ids: list[int]
                         ) -> Optional[dict]:
    if body.logprobs is None:
        return None
    as_ids = front.tokens_as_ids(body)
    tokens = [front.token_text(t, as_ids) for t in ids]
    lps = s.logprobs[start:start + len(ids)]
    rows = s.top_logprobs[start:start + len(ids)] if s.top_logprobs is not None else [None] * len(ids)
    tops = [{front.token_text(t, as_ids): lp for t, lp in completion_top(row, body.logprobs, tok, tok_lp)}
            for tok, tok_lp, row in zip(ids, lps, rows)]
    offsets, at = [], len(front.codec.decode(s.ids[:start])) if start else 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


# ---- chat completions ----------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    front = front_of(request)
    body.model = front.check_model(body.model)
    try:
        plan = plan_tools(body.tool_choice, body.tools, front.config.tool_parser, body.parallel_tool_calls)
    except ToolChoiceError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None
    session_id = body.session_id or request.headers.get(SESSION_HEADER) or None
    messages = [m.as_template_dict() for m in body.messages]
    render = Render(body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)
    prompt, _ = await front.chat_prompt(session_id, messages, body.tools, render)
    front.check_ids([prompt], "messages")
    max_tokens = front.completion_budget([prompt], body.completion_limit(), "messages", defaulted=True)
    top = (body.top_logprobs or 0) if body.logprobs else None
    spec = _spec(front, body, [prompt], max_tokens, top, session_id=session_id,
                 prompt_logprobs=body.prompt_logprobs, forced=plan.forced)
    gen = front.generation(spec)
    rid = f"chatcmpl-{spec.rid}"
    headers = {SESSION_HEADER: session_id} if session_id else None

    def remember() -> None:
        if session_id:
            replies = []
            for s in gen.samples:
                content, calls = _parse_reply(plan, s.text)
                matched = calls_of([c.as_dict() for c in calls]) or ()
                replies.append(Reply(s.text, list(s.ids), content if calls else None, matched))
            front.sessions.record(session_id, messages, body.tools, prompt, replies, render)

    if body.stream:
        return _stream(gen, _chat_chunks(front, body, gen, rid, remember, plan), headers)
    samples = await unless_disconnected(request, gen.run())
    remember()
    choices = []
    for i, s in enumerate(samples):
        content, calls = _parse_reply(plan, s.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
        choice = {"index": i, "message": message, "logprobs": _chat_logprobs(front, body, s, 0, s.ids),
                  "finish_reason": plan.finish_reason(bool(calls), s.finish_reason), "stop_reason": _stop_reason(s)}
        if body.return_token_ids is not False:
            choice["token_ids"] = s.ids
            choice["prompt_token_ids"] = prompt
            choice["weight_versions"] = version_spans(s.versions)
        choices.append(choice)
    out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": body.model,
           "choices": choices, "usage": _usage([prompt], samples)}
    if body.return_token_ids is not False:
        out["prompt_token_ids"] = prompt
    if body.prompt_logprobs is not None:
        out["prompt_logprobs"] = _prompt_logprobs(front, body, prompt, samples[0], body.prompt_logprobs)
    return json_response(out, headers=headers)


async def _chat_chunks(front: HttpFront, body: ChatCompletionRequest, gen: Generation, rid: str,
                       done: Any, plan: ToolPlan) -> AsyncIterator[bytes]:
    created, first = int(time.time()), set()
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model}
    tools = {_index(gen, s): plan.stream() for s in gen.samples}
    async for d in gen.deltas():
        s = d.sample
        index = _index(gen, s)
        delta: dict[str, Any] = {"content": d.text}
        finish_reason = d.finish_reason
        calls = tools[index]
        # NOTE: text that may be a call is held back, a call sent whole (rollout.http.core.tools)
        if calls is not None:
            out = calls.feed(d.text)
            if d.finish_reason is not None:
                out += calls.finish()
                finish_reason = plan.finish_reason(bool(calls.calls), finish_reason)
            delta["content"] = out.content
            if out.calls:
                delta["tool_calls"] = [call.as_delta(i) for i, call in out.calls]
        chunk = dict(head)
        if index not in first:
            first.add(index)
            delta["role"] = "assistant"
            if body.return_token_ids is not False:
                chunk["prompt_token_ids"] = gen.spec.prompts[0]
        choice = {"index": index, "delta": delta, "logprobs": _chat_logprobs(front, body, s, d.start, d.ids),
                  "finish_reason": finish_reason}
        if body.return_token_ids is not False:
            choice["token_ids"] = d.ids
            choice["weight_versions"] = version_spans(s.versions[d.start:d.start + len(d.ids)], d.start)
        chunk["choices"] = [choice]
        if _continuous_usage(body):
            chunk["usage"] = _usage(gen.spec.prompts, gen.samples)
        yield sse(chunk)
    done()
    if body.stream_options is not None and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": _usage(gen.spec.prompts, gen.samples)})


def _chat_logprobs(front: HttpFront, body: ChatCompletionRequest, s: Sample, start: int, ids: list[int]
                   ) -> Optional[dict]:
    if not body.logprobs:
        return None
    as_ids = front.tokens_as_ids(body)
    content = []
    for j, t in enumerate(ids):
        token, lp = front.token_text(t, as_ids), s.logprobs[start + j]
        row = s.top_logprobs[start + j] if s.top_logprobs is not None else None
        tops = []
        for alt, alt_lp in chat_top(row, body.top_logprobs or 0, t, lp):
            alt_text = front.token_text(alt, as_ids)
            tops.append({"token": alt_text, "logprob": alt_lp, "bytes": list(alt_text.encode())})
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": tops})
    return {"content": content}


# ---- shared --------------------------------------------------------------------------------------


def _spec(front: HttpFront, body: Any, prompts: list[list[int]], max_tokens: int, logprobs: Optional[int], *,
          n: Optional[int] = None, session_id: Optional[str] = None, prompt_logprobs: Optional[int] = None,
          forced: Optional[StructuredOutputs] = None) -> GenSpec:
    n = body.n if n is None else n
    sampling = front.sampling(body, n=n, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              structured=structured.from_openai(body, forced))
    return GenSpec(prompts, n, sampling, stops=body.stop_strings(), include_stop=body.include_stop_str_in_output,
                   skip_special_tokens=body.skip_special_tokens, stream=body.stream, session_id=session_id,
                   rid=uuid.uuid4().hex)


def _stream(gen: Generation, chunks: AsyncIterator[bytes], headers: Optional[dict[str, str]] = None
            ) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # noqa: BLE001 (headers are sent: the error goes into the stream)
            err = from_exception(exc)
            yield sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _parse_reply(plan: ToolPlan, text: str) -> tuple[Optional[str], list]:
    """`plan.parse`, a forced reply that names no call refused as vLLM refuses it (400, the cause)."""
    try:
        return plan.parse(text)
    except ForcedCallError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None


def _index(gen: Generation, s: Sample) -> int:
    return s.group * gen.spec.n + s.index


def _stop_reason(s: Sample) -> Any:
    return s.matched if isinstance(s.matched, str) else None


def _continuous_usage(body: Any) -> bool:
    """vLLM's `stream_options.continuous_usage_stats`: every chunk says the usage so far."""
    options = body.stream_options
    return options is not None and options.include_usage and options.continuous_usage_stats


def _usage(prompts: list[list[int]], samples: list[Sample]) -> dict[str, Any]:
    """vLLM's usage, with `prompt_tokens_details.cached_tokens` always (as under its
    `--enable-prompt-tokens-details`): per prompt, the fewest its samples found cached (the one
    that prefilled it; forks would count its blocks again), never above the prompt's length."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(s.ids) for s in samples)
    cached: dict[int, int] = {}
    for s in samples:
        cached[s.group] = min(cached.get(s.group, s.cached_tokens), s.cached_tokens)
    cached_tokens = sum(min(n, len(prompts[g])) for g, n in cached.items())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


__all__ = ["Delta", "router"]
