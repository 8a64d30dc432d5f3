"""Error replies as the clients expect them: OpenAI's body under `/v1`, SGLang's elsewhere.

OpenAI (and vLLM, which copies it; vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info` too):
status 400 / 404 / 401 / 500 with
`{"error": {"message", "type", "param", "code"}}`; e.g. an unknown field is
"Unrecognized request argument supplied: X", an unknown model is 404 with code `model_not_found`,
a prompt past the context is 400 with code `context_length_exceeded`.
SGLang's native routes: a request its schema refuses is 400 with
`{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}` (its handler
of FastAPI's validation errors); a request its handler refuses is 400 with `{"error": {"message"}}`.
Every handler here answers and the server goes on serving.

What cannot be served now says when to come back (`Retry-After`), as OpenAI and vLLM do: 429 when
the engine's waiting queue is full (OVERLOADED), 503 while the engine is suspended or in a state
that refuses the call; a context error that is transient (the engine's memory released) is such
a state, a permanent one is the client's 400. An engine whose weights await an update (after a
deep sleep) answers 503 with `x-should-retry: false`: the openai SDK does not retry it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from http import HTTPStatus
from typing import Any, Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference import SamplingParams
from inference.errors import ContextOverflowError, EngineStateError, OverloadedError, WeightsUnavailableError
from rollout.http.core.schemas import ValidationKind
from rollout.text import PromptTooLongError, TokenizerUnavailableError
from rollout.wire.codec import ProtocolError
from rollout.wire.kinds import ErrorCode

logger = logging.getLogger(__name__)


RETRY_AFTER_S = 1.0  # what a refusal for now advises when the engine said nothing more precise


class APIError(Exception):
    """A refusal with an HTTP status and OpenAI's error fields (`type`, `param`, `code`);
    `retry_after_s`: sent as `Retry-After` (whole seconds, at least 1)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 retry_after_s: Optional[float] = None, should_retry: Optional[bool] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = int(status), message, type, param, code
        self.retry_after_s, self.should_retry = retry_after_s, should_retry

    @property
    def headers(self) -> Optional[dict[str, str]]:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.should_retry is not None:  # NOTE: the openai SDK obeys it before the status (its _should_retry)
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        return headers or None


VLLM_ROOT_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})  # vLLM's, answered in its shape


def is_openai_path(path: str) -> bool:
    return path.startswith(("/v1/", "/inference/v1/")) or path == "/v1" or path in VLLM_ROOT_PATHS


def error_response(request: Request, err: APIError, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    if is_openai_path(request.url.path):
        body: dict[str, Any] = {"error": {"message": err.message, "type": err.type, "param": err.param,
                                          "code": err.code}}
    else:
        body = {"error": {"message": err.message}}
    return JSONResponse(body, status_code=err.status, headers={**(err.headers or {}), **(headers or {})})


def unavailable(message: str, retry_after_s: Optional[float] = None) -> APIError:
    """503: the engine cannot serve this now (suspended, paused for a weight update, ...)."""
    return APIError(503, message, type="server_error", code="engine_unavailable",
                    retry_after_s=RETRY_AFTER_S if retry_after_s is None else retry_after_s)


def no_weights(message: str) -> APIError:
    """503 that says not to retry: the engine holds no weights until a weight update (a deep sleep
    discarded them); a client retrying on a timer would only spin until the trainer sends them."""
    return APIError(503, message, type="server_error", code="weights_unavailable", should_retry=False)


def overloaded(message: str, retry_after_s: Optional[float] = None) -> APIError:
    """429: the engine's waiting queue is full; nothing is wrong with the request."""
    return APIError(429, message, type="server_error", code="overloaded",
                    retry_after_s=RETRY_AFTER_S if retry_after_s is None else retry_after_s)


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
BODY_NAMES = {"bad_words_token_ids": "bad_words"}  # an engine field -> the request field it came from
_FIELD_AT_START = re.compile(r"^(?:[A-Z_]+: )?(?:ValueError: )?(?:sampling\.)?([a-z_]+)\b")


def engine_param(message: str) -> Optional[str]:
    """The request field an engine's refusal names (its messages start with the field's name)."""
    match = _FIELD_AT_START.match(message)
    if match is None or match.group(1) not in SAMPLING_FIELDS:
        return None
    return BODY_NAMES.get(match.group(1), match.group(1))


async def engine_call(awaitable: Any) -> Any:
    """`await awaitable`, an engine-side refusal raised as the `APIError` it means (`from_exception`)."""
    try:
        return await awaitable
    except Exception as exc:  # noqa: BLE001 (mapped onto the HTTP status it means)
        raise from_exception(exc) from None


def from_exception(exc: BaseException) -> APIError:
    """What an exception from the engine side means to an HTTP client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        if exc.is_transient:  # e.g. TensorStateDeallocatedError: the engine's memory is released for now
            return unavailable(str(exc))
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, OverloadedError):
        return overloaded(str(exc), exc.retry_after_s)
    if isinstance(exc, ProtocolError):
        if exc.code is ErrorCode.OVERLOADED:
            return overloaded(str(exc))
        if exc.code is ErrorCode.ENGINE_STATE:
            return unavailable(str(exc))
        if exc.code is ErrorCode.NO_WEIGHTS:
            return no_weights(str(exc))
        if exc.code in (ErrorCode.INVALID_REQUEST, ErrorCode.BAD_SCHEMA):
            return APIError(400, str(exc), param=engine_param(str(exc)))
        if exc.code is ErrorCode.NOT_FOUND:  # e.g. a LoRA adapter not loaded
            return APIError(404, str(exc), code="not_found")
        if exc.code is ErrorCode.TOO_LARGE:
            return APIError(413, str(exc), code="request_too_large")
        return APIError(500, str(exc), type="server_error")
    if isinstance(exc, WeightsUnavailableError):
        return no_weights(str(exc))
    if isinstance(exc, EngineStateError):
        return unavailable(str(exc))
    if isinstance(exc, TimeoutError):
        return APIError(504, f"the engine did not answer in time: {exc}", type="server_error", code="timeout")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param="prompt", code="context_length_exceeded")
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc), param=engine_param(str(exc)))
    if isinstance(exc, RecursionError):  # NOTE: a body nested too deep for a reader that recurses
        return APIError(400, "The request body is nested too deep to read.")
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """OpenAI's wording for the first problem: the message and the offending field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    kind = ValidationKind.of(first.get("type"))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if kind is ValidationKind.MODEL_ATTRIBUTES_TYPE and not loc and isinstance(first.get("input"), (bytes, str)):
        return "The request body must be JSON, sent with `Content-Type: application/json`.", None
    if kind in (ValidationKind.JSON_INVALID, ValidationKind.JSON_TYPE) or (kind is ValidationKind.MISSING and not loc):
        return ("We could not parse the JSON body of your request. The API expects a JSON object as the "
                "request body; what was sent was not valid JSON.", None)
    if kind is ValidationKind.LONE_SURROGATE:
        field = str(first.get("ctx", {}).get("field", param))
        return (f"Invalid value for '{field}': it holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                "escape), which is not Unicode text.", field)
    if kind is ValidationKind.FIELD_ERROR:
        return str(first.get("msg", "invalid")), str(first.get("ctx", {}).get("field", param))
    if kind is ValidationKind.EXTRA_FORBIDDEN:
        return f"Unrecognized request argument supplied: {param}", param
    if kind is ValidationKind.MISSING:
        return f"Missing required parameter: '{param}'.", param
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return f"Invalid value for '{param}': {first.get('msg', 'invalid')} (got {shown}).", param


async def validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    if is_openai_path(request.url.path):
        return error_response(request, APIError(400, message, param=param))
    return JSONResponse({"object": "error", "message": message, "type": HTTPStatus.BAD_REQUEST.phrase,
                         "param": None, "code": 400}, status_code=400)


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return error_response(request, exc)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method not allowed ({request.method} {request.url.path})"
    else:
        message = str(exc.detail)
    return error_response(request, APIError(exc.status_code, message, code=None), headers=exc.headers)


async def no_tokenizer_handler(request: Request, exc: TokenizerUnavailableError) -> JSONResponse:
    """Text asked of a token-only front (`--skip-tokenizer-init`), wherever a route met it."""
    return error_response(request, APIError(400, str(exc)))


async def too_deep_handler(request: Request, exc: RecursionError) -> JSONResponse:
    """A body nested deeper than Python reads (JSON decoding, a schema walked by recursion): the
    client's 400, whichever route met it."""
    return error_response(request, from_exception(exc))


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("%s %s failed", request.method, request.url.path)
    return error_response(request, APIError(500, f"{type(exc).__name__}: {exc}", type="server_error"))


def install(app: Any) -> None:
    app.add_exception_handler(RequestValidationError, validation_handler)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(TokenizerUnavailableError, no_tokenizer_handler)
    app.add_exception_handler(RecursionError, too_deep_handler)
    app.add_exception_handler(Exception, internal_error_handler)
