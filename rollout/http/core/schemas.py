"""Request bodies of the HTTP routes, validated by pydantic (FastAPI answers a refusal with 400).

OpenAI's requests forbid unknown fields ("Unrecognized request argument supplied"); the extra
fields accepted are vLLM's names for the same things (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `bad_words`, `allowed_token_ids`, `cache_salt`, `stop_token_ids`, `ignore_eos`,
`prompt_logprobs`, `return_token_ids`, `return_tokens_as_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, and for chat `chat_template_kwargs`, `add_generation_prompt`,
`continue_final_message`) plus `session_id` and `prefix_cache_policy`. Every accepted field is
honoured; what this engine cannot do is accepted only at its neutral value (`suffix` ""), so a request is never silently
answered differently from what it asked. `model` may be left out (the first served name).

SGLang's `/generate` and control bodies use SGLang's names (see `rollout.http.sglang.sglang_routes`).

Every string of a body, at any depth (dict keys too), must be Unicode text: JSON lets a body
escape a lone UTF-16 surrogate (`"\\ud800"`), which no tokenizer, chat template or JSON encoder
takes, so a body holding one is refused (400, naming the field) before a route sees it.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from inference.sampling.params import MAX_CACHE_SALT_LENGTH

MAX_N = 128
MAX_STOP = 1024  # vLLM has no limit (OpenAI's is 4): a bound against abuse only
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI's for chat); a server's: FrontConfig.max_logprobs
MAX_PENALTY = 100.0  # a repetition penalty past this only makes the model unreadable
MAX_WORDS = 1024  # bad_words: a bound against abuse only
Prob = Annotated[float, Field(ge=0, le=1)]


class ValidationKind(enum.StrEnum):
    """The validation error types `rollout.http.core.errors` words for clients: pydantic's (its own
    strings, read once at the edge by `of`) and the two these schemas raise."""

    JSON_INVALID = "json_invalid"
    JSON_TYPE = "json_type"
    MISSING = "missing"
    EXTRA_FORBIDDEN = "extra_forbidden"
    MODEL_ATTRIBUTES_TYPE = "model_attributes_type"  # a body that is no object (form data, bare text)
    LONE_SURROGATE = "lone_surrogate"
    FIELD_ERROR = "field_error"  # a check across fields: its message as is, `param` the field it names
    OTHER = "other"  # any other of pydantic's: a field's value refused, worded from pydantic's message

    @classmethod
    def of(cls, error_type: object) -> ValidationKind:
        try:
            return cls(error_type)
        except ValueError:
            return cls.OTHER


def refuse(field: str, message: str) -> PydanticCustomError:
    """A body refused for `field` (a model validator's error has no location of its own)."""
    return PydanticCustomError(ValidationKind.FIELD_ERROR.value, message.replace("{", "{{").replace("}", "}}"),
                               {"field": field})


def lone_surrogate_at(data: Any) -> Optional[str]:
    """The dotted path of the first string (or key) in `data` holding a lone surrogate, else None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # NOTE: iterative: a body nested as deep as JSON allows must not exhaust the stack
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and lone_surrogate_at(key) is not None:
                    return where.encode("utf-8", "backslashreplace").decode()
                stack.append((where, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
    return None


class Strict(BaseModel):
    """A request body: unknown fields refused, every string Unicode text (see module docstring)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise PydanticCustomError(ValidationKind.LONE_SURROGATE.value, "{field} holds a lone UTF-16 surrogate",
                                      {"field": where})
        return data


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsBody(Strict):
    """vLLM's `structured_outputs` (its `StructuredOutputsParams` fields; rollout.http.core.structured).
    `disable_fallback` is honoured trivially: there is one backend (llguidance) and no fallback.
    NOTE: `json` is `json_` here (pydantic's BaseModel has a `json` attribute)."""

    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[Annotated[list[str], Field(min_length=1)]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`; `schema` is required here (vLLM's too, in effect)."""

    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: Optional[str] = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    """OpenAI's `response_format` (text, json_object, json_schema) and vLLM's structural tag
    (`structures` and `triggers`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaFormat] = None
    structures: Optional[list[dict[str, Any]]] = None
    triggers: Optional[list[str]] = None

    @model_validator(mode="after")
    def _complete(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise refuse("response_format", "response_format of type json_schema needs `json_schema` "
                                            "(with its `schema`).")
        if self.type == "structural_tag" and (not self.structures or not self.triggers):
            raise refuse("response_format", "response_format of type structural_tag needs `structures` and "
                                            "`triggers`.")
        return self


class _Sampling(Strict):
    """What completions and chat completions share."""

    model: Optional[str] = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[Annotated[int, Field(ge=0, lt=2**63)]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    frequency_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None
    user: Optional[str] = None
    # vLLM's extra sampling fields
    top_k: Optional[Annotated[int, Field(ge=-1)]] = None
    min_p: Optional[Annotated[float, Field(ge=0, lt=1)]] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0, le=MAX_PENALTY)]] = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    bad_words: Optional[Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_WORDS)]] = None
    allowed_token_ids: Optional[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]] = None
    cache_salt: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    # this engine's: "reset" (match only K/V of the current weights) or "salted" (a session's turns
    # keep matching the blocks of the version it started with); None: the engine's own policy
    prefix_cache_policy: Optional[Literal["reset", "salted"]] = None
    prompt_logprobs: Optional[Annotated[int, Field(ge=0)]] = None  # NOTE: at most the server's max_logprobs
    # which distribution the log-probs come from: raw (the model's, what a trainer recomputes; the
    # default) or processed (the one sampled from); vLLM's server-wide names are taken too
    logprobs_mode: Optional[Literal["raw", "processed", "raw_logprobs", "processed_logprobs"]] = None
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: Optional[bool] = None  # None: returned (RL clients need them); False: left out
    return_tokens_as_token_ids: Optional[bool] = None  # NOTE: None: the server's default (vLLM's flag)
    session_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    # structured outputs (rollout.http.core.structured): vLLM's field or OpenAI's, not both
    structured_outputs: Optional[StructuredOutputsBody] = None
    response_format: Optional[ResponseFormat] = None

    @model_validator(mode="after")
    def _shared_checks(self) -> _Sampling:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise refuse("stop", f"stop may hold at most {MAX_STOP} strings, got {len(self.stop)}.")
        if self.prompt_logprobs is not None and self.stream:
            raise refuse("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)


class CompletionRequest(_Sampling):
    prompt: Union[str, Annotated[list[str], Field(min_length=1)], Annotated[list[int], Field(min_length=1)],
                  Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]]
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = 16  # 0 only with echo: the prompt scored, nothing sampled
    logprobs: Optional[Annotated[int, Field(ge=0)]] = None  # NOTE: at most the server's max_logprobs
    echo: bool = False
    best_of: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = None
    suffix: Optional[Literal[""]] = None

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise refuse("best_of", f"best_of must be greater than or equal to n, got n={self.n} and "
                                    f"best_of={self.best_of}.")
        if self.best_of is not None and self.best_of > 1 and self.stream:
            raise refuse("best_of", "best_of is not supported with stream=True.")
        if self.max_tokens == 0 and not self.echo:
            raise refuse("max_tokens", "max_tokens must be at least 1 (0 only with echo), got 0.")
        return self


class ChatMessage(BaseModel):
    """One message; unknown fields pass through to the chat template (harnesses add their own)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message for the chat template: content as one string, absent fields left out."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text")
        out.setdefault("content", "")
        return out


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0)]] = None  # NOTE: at most the server's max_logprobs
    tools: Optional[list[dict[str, Any]]] = None
    # rollout.http.core.tools
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # vLLM's chat fields
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise refuse("continue_final_message", "Cannot set both `continue_final_message` and "
                                                   "`add_generation_prompt` to True.")
        return self

    def completion_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- SGLang's native routes ------------------------------------------------------------------------


class SGLangSampling(Strict):
    """SGLang's `sampling_params` (its SamplingParams names); at most one of its constraints
    (`json_schema`, `regex`, `ebnf`, `structural_tag`: rollout.http.core.structured)."""

    max_new_tokens: Annotated[int, Field(ge=1)] = 128
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = None
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0, lt=1)] = 0.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Optional[Annotated[int, Field(ge=0, lt=2**63)]] = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_PENALTY)] = 1.0
    min_new_tokens: Annotated[int, Field(ge=0)] = 0
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    # NOTE: slime asks `{"return_top_p_token_ids": true}` (its top-p replay): refused, not ignored
    custom_params: Optional[dict[str, Any]] = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    @model_validator(mode="after")
    def _no_custom_params(self) -> SGLangSampling:
        if self.custom_params:
            raise ValueError(f"custom_params {sorted(self.custom_params)} are not served: this engine runs no "
                             "custom logit processors and returns no top-p token ids (sampling masks)")
        return self


class GenerateReqInput(Strict):
    """SGLang's `GenerateReqInput`: one prompt or a batch (`text` or `input_ids`, not both)."""

    text: Optional[Union[str, Annotated[list[str], Field(min_length=1)]]] = None
    input_ids: Optional[Union[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)],
                              Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
                                        Field(min_length=1)]]] = None
    sampling_params: Optional[Union[SGLangSampling, list[SGLangSampling]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Optional[Union[bool, list[bool]]] = None
    logprob_start_len: Optional[Union[int, list[int]]] = None
    top_logprobs_num: Optional[Union[Annotated[int, Field(ge=0)], list[int]]] = None  # NOTE: <= max_logprobs
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False
    image_data: Optional[Any] = None  # NOTE: AReaL sends `null` with every request; a text model takes no image
    lora_path: Optional[Union[str, list[Optional[str]]]] = None
    # SGLang's cache namespace (the engine's `cache_salt`): requests with different keys never share a block
    extra_key: Optional[Union[Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_LENGTH)],
                              list[Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_LENGTH)]]]] = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("Either text or input_ids should be provided, not both")
        if any(x is not None for x in _each(self.image_data)):
            raise ValueError("image_data: this server serves a text model, which takes no images")
        return self


def _each(value: Any) -> list:
    """A field SGLang takes for one prompt or per prompt, as a list."""
    return value if isinstance(value, list) else [value]


class AbortReq(Strict):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationReqInput(Strict):
    tags: Optional[list[Literal["kv_cache", "weights", "cuda_graph"]]] = None


class UpdateWeightFromDiskReqInput(Strict):
    model_path: str
    load_format: Optional[Literal["auto"]] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class InitWeightsUpdateGroupReqInput(Strict):
    """SGLang's fields; `backend` None (not SGLang's "nccl") lets the engine pick gloo on CPU, nccl
    on GPU; `rank_offset` is this replica's rank (the trainer is rank 0)."""

    master_address: Annotated[str, Field(min_length=1, max_length=255)]
    master_port: Annotated[int, Field(ge=1, le=65535)]
    rank_offset: Annotated[int, Field(ge=1)]
    world_size: Annotated[int, Field(ge=2)]
    group_name: str = "weight_update_group"
    backend: Optional[Literal["nccl", "gloo"]] = None


class UpdateWeightsFromDistributedReqInput(Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[Literal["flattened_bucket"]] = None

    @model_validator(mode="after")
    def _aligned(self) -> UpdateWeightsFromDistributedReqInput:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError("names, dtypes and shapes must have one entry per tensor")
        return self


class UpdateWeightsFromTensorReqInput(Strict):
    """SGLang's fields; each entry of `serialized_named_tensors` is our msgpack shared-memory handle
    (base64), one per engine rank; a pickled one (SGLang's own serializer) is refused."""

    serialized_named_tensors: Annotated[list[str], Field(min_length=1)]
    load_format: Optional[Literal["flattened_bucket", "auto"]] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class DestroyWeightsUpdateGroupReqInput(Strict):
    group_name: str = "weight_update_group"
