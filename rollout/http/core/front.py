"""HttpFront: what the HTTP routes share: the async client, the tokenizer, sessions, checks.

One front talks to one engine or fleet through one `FrontClient` (`rollout.http.core.clients`): over
ZMQ to a `rollout serve` server or a `rollout route` router (`ServiceClient`), or to the engine in
this process (`rollout.client.in_process.InProcessClient`, what `rollout serve --http` runs), the
same calls and answers. Its event loop never waits on an engine: replies are futures settled from
the client's I/O thread or the engine's loop; tokenizing and rendering a chat prompt (which grows
with the conversation) run on a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from inference import LogprobsMode, SamplingParams
from inference.sampling.params import MAX_LOGPROBS
from rollout.http.core.clients import FrontClient
from rollout.http.core.errors import APIError, from_exception
from rollout.http.core.generation import Generation, GenSpec
from rollout.http.core.sampling import LOGPROBS_MODES, sampling_params
from rollout.http.core.schemas import MAX_TOP_LOGPROBS
from rollout.http.core.sessions import Render, SessionStore
from rollout.http.core.tools import TOOL_PARSERS, ToolParser
from rollout.text import ChatTemplateError, PromptTooLongError, TextCodec


@dataclass(slots=True)
class FrontConfig:
    """`model_name`: the served name reported (and the `model` of a request that names none);
    `aliases`: other names a request's `model` may be; `max_model_len`: the longest prompt +
    completion the engine takes; `timeout`: the bound of every engine call, in seconds;
    `tool_parser`: how chat replies are parsed for tool calls (`rollout.http.core.tools`); `max_logprobs`:
    the largest top-n log-prob count a request may ask (vLLM's `--max-logprobs`); `logprobs_mode`:
    raw or processed, for requests that name none (`--logprobs-mode`); `closed_routes`: paths
    answered 404, as a server without them (vLLM's dev routes outside its dev mode)."""

    model_name: str
    max_model_len: int
    aliases: tuple[str, ...] = ()
    model_path: str = ""
    timeout: float = 600.0
    max_sessions: int = 4096
    session_ttl_s: float = 3600.0
    api_key: Optional[str] = None
    tool_parser: ToolParser = ToolParser.NONE
    # (field, value): `rollout.http.core.sampling.generation_defaults`
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as `token_id:N` where a request does not say
    max_logprobs: int = MAX_TOP_LOGPROBS
    logprobs_mode: LogprobsMode = LogprobsMode.RAW  # its name (raw, processed) is taken too
    closed_routes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.tool_parser, ToolParser):
            if self.tool_parser not in TOOL_PARSERS:
                raise ValueError(f"FrontConfig.tool_parser must be one of {', '.join(TOOL_PARSERS)}, "
                                 f"got {self.tool_parser!r}")
            self.tool_parser = ToolParser(self.tool_parser)
        if not self.model_name or not all(self.aliases):
            raise ValueError("FrontConfig.model_name and aliases must not be empty")
        if self.max_model_len < 2:
            raise ValueError(f"FrontConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.timeout <= 0:
            raise ValueError(f"FrontConfig.timeout must be > 0, got {self.timeout}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"FrontConfig.max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        if not isinstance(self.logprobs_mode, LogprobsMode):
            if self.logprobs_mode not in LOGPROBS_MODES:
                raise ValueError(f"FrontConfig.logprobs_mode must be raw or processed, got {self.logprobs_mode!r}")
            self.logprobs_mode = LOGPROBS_MODES[self.logprobs_mode]


class HttpFront:
    """State of the HTTP front (see module docstring). `inflight`: rid -> running `Generation`."""

    def __init__(self, client: FrontClient, codec: TextCodec, config: FrontConfig,
                 loras: Optional[dict[str, str]] = None) -> None:
        self.client, self.codec, self.config = client, codec, config
        if codec.max_tokens is None:  # NOTE: text past the context is refused before tokenizing (rollout.text)
            codec.max_tokens = config.max_model_len
        self.sessions = SessionStore(config.max_sessions, config.session_ttl_s)
        self.inflight: dict[str, Generation] = {}
        self.created = int(time.time())
        # LoRA adapters a request's `model` may name: name -> path, as the engine last listed them
        # (refreshed by the load / unload routes and by /v1/models; `loras`: those loaded before it started)
        self.loras: dict[str, str] = dict(loras or {})
        # NOTE: loads and unloads one at a time: "already loaded?" and the load it guards are one step,
        # so two loads of one name sent together load it once (the second: vLLM's 400)
        self.lora_changes = asyncio.Lock()

    @property
    def timeout(self) -> float:
        return self.config.timeout

    # ---- checks --------------------------------------------------------------------------------

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.config.model_name, *self.config.aliases)

    def check_model(self, model: Optional[str]) -> str:
        """The served name a request's `model` means (None: the first); 404 for another."""
        if model is None:
            return self.config.model_name
        if model not in self.model_names and model not in self.loras:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def with_adapter(self, params: SamplingParams, model: Optional[str]) -> SamplingParams:
        """`params` on the LoRA adapter that `model` names (unchanged for the base model's names)."""
        return dataclasses.replace(params, lora_name=model) if model in self.loras else params

    async def refresh_loras(self, timeout: Optional[float] = None) -> list:
        """The engine's loaded adapters (`wire.LoraInfo`), remembered for `check_model`."""
        infos = await self.client.list_loras(timeout=self.timeout if timeout is None else timeout)
        self.loras = {i.name: i.path or "" for i in infos}
        return infos

    def check_ids(self, prompts: list[list[int]], param: str = "prompt") -> None:
        vocab = self.codec.vocab_size
        for prompt in prompts:
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"Token id {bad} is out of vocabulary (size {vocab}).", param=param)

    def completion_budget(self, prompts: list[list[int]], max_tokens: Optional[int], param: str,
                          defaulted: bool = False) -> int:
        """`max_tokens`, or all the context left; refused (OpenAI's 400) past the context. `defaulted`
        (the OpenAI routes): also at most the generation config's `max_new_tokens`, as vLLM caps it."""
        longest = max(len(p) for p in prompts)
        limit = self.config.max_model_len
        if max_tokens is None:
            max_tokens = limit - longest
        if longest + max_tokens > limit or max_tokens < 1:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{longest + max_tokens} tokens ({longest} in the {param}, {max_tokens} in the "
                                "completion). Please reduce the length of the prompt or completion.",
                           param=param, code="context_length_exceeded")
        cap = dict(self.config.sampling_defaults).get("max_tokens") if defaulted else None
        return max_tokens if cap is None else min(max_tokens, int(cap))

    # ---- building blocks -----------------------------------------------------------------------

    def tokens_as_ids(self, body: Any) -> bool:
        """Whether `body`'s logprobs name tokens as `token_id:N` (its field, else the server's default)."""
        asked = getattr(body, "return_tokens_as_token_ids", None)
        return self.config.return_tokens_as_token_ids if asked is None else asked

    def sampling(self, body: Any, *, n: int, max_tokens: int, logprobs: Optional[int],
                 prompt_logprobs: Optional[int] = None, structured: Any = None) -> SamplingParams:
        """The engine's `SamplingParams` of a completions or chat body (`rollout.http.core.sampling`);
        `structured`: its constraint (`rollout.http.core.structured`)."""
        params = sampling_params(self.codec, body, n=n, max_tokens=max_tokens, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs, structured=structured,
                                 defaults=dict(self.config.sampling_defaults), **self.logprob_rules())
        return self.with_adapter(params, getattr(body, "model", None))

    def logprob_rules(self) -> dict[str, Any]:
        """`sampling_params`' server-wide log-prob arguments."""
        return {"max_logprobs": self.config.max_logprobs, "logprobs_mode": self.config.logprobs_mode}

    def generation(self, spec: GenSpec) -> Generation:
        if spec.stops and not self.codec.has_text:  # NOTE: stop strings are matched on the decoded text
            raise APIError(400, str(self.codec.refuse("a stop string")), param="stop")
        return Generation(self, spec)

    async def abort_where(self, chosen: Callable[[str], bool]) -> int:
        """Abort the running generations whose request id `chosen` picks; how many."""
        gens = [gen for rid, gen in list(self.inflight.items()) if chosen(rid)]
        await asyncio.gather(*(gen.abort() for gen in gens))
        return len(gens)

    async def encode(self, text: str) -> list[int]:
        try:
            return await asyncio.to_thread(self.codec.encode, text)
        except PromptTooLongError as exc:
            raise from_exception(exc) from None

    async def chat_prompt(self, session_id: Optional[str], messages: list[dict], tools: Optional[list[dict]],
                          render: Optional[Render] = None) -> tuple[list[int], bool]:
        try:
            return await asyncio.to_thread(self.sessions.prompt_ids, self.codec, session_id, messages, tools, render)
        except PromptTooLongError as exc:
            raise from_exception(exc) from None
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None

    def token_text(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.codec.token_texts([token_id])[0]

    async def policy_version(self) -> int:
        return await self.client.policy_version()

