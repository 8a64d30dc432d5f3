"""Per-request sampling parameters, validated once at construction.

`SamplingParams` is created for every request, so validation is a handful of plain comparisons
(no tensors, no copies beyond normalising token-id tuples to lists). Every error is a
`ValueError` whose message starts with the offending field's name.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta

from inference.bounded import NonNegInt
from inference.kv_cache.policy import PrefixCachePolicy
from inference.sampling.structured import StructuredOutputs

MAX_LOGPROBS = 100  # the largest top-n a request may ask for (sampled or prompt log-probs)
# NOTE: the sampler keeps temperatures in float32 and takes 1 / T: below MIN_TEMPERATURE 1 / T
# overflows (0 * inf = NaN at the max logit), above MAX_TEMPERATURE sampling is uniform anyway;
# top_k lives in an int64 tensor and is cut to the vocabulary, so anything above int32 is a bug.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6
MAX_TOP_K = 2**31 - 1
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)
# NOTE: each bad word is state kept and matched per slot and step: a bound against one request
# stalling every other one (the wire and the HTTP fronts hold the same bound)
MAX_BAD_WORDS = 1024
MAX_CACHE_SALT_LENGTH = 256
MAX_LORA_NAME_LENGTH = 256
# NOTE: bounds only the wire holds a request to (a decoded frame is checked against them): what one
# peer may ask of a shared server
MAX_SAMPLES = 1024  # n
MAX_STOP_TOKENS = 1024  # stop_token_ids, and the tokens of one bad-word sequence
MAX_TOKEN_IDS = 1 << 20  # allowed_token_ids, logit_bias entries (a vocabulary's worth)

# the fields' bounds as msgspec reads them: the wire decodes `SamplingParams` itself, these checked
# first (a refusal names the field), then `__post_init__` (what a range cannot say)
_TopN = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
_Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
_Bias = Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
_TokenSequence = Annotated[list[NonNegInt], Meta(min_length=1, max_length=MAX_STOP_TOKENS)]


class LogprobsMode(enum.IntEnum):
    """Which distribution the returned log-probs are taken from.

    RAW: `log_softmax` of the model's raw logits (before any logit processor), exactly what a
    trainer recomputes; the default, because importance ratios and KL terms compare against it.
    PROCESSED: the distribution actually sampled from, after the logit processors (penalties,
    bias, bans), temperature, top-k, top-p and min-p (tokens banned or cut away have log-prob
    -inf). Greedy rows use temperature 1 here.
    """

    RAW = 0
    PROCESSED = 1


def _is_int(value: object) -> bool:
    # NOTE: bool is an int subclass; `top_k=True` is a bug in the caller, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_token_list(name: str, value: object, *, allow_empty: bool) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints, got {value!r}")
    if not value and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    for tok in value:
        if not (_is_int(tok) and tok >= 0):
            raise ValueError(f"{name} must hold ints >= 0, got {tok!r}")
    return list(value)


def _check_top_n(name: str, value: object) -> None:
    if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's completions.

    Invariants (checked in `__post_init__`):
      n >= 1 samples per prompt; temperature 0 (greedy argmax) or in [MIN_TEMPERATURE,
      MAX_TEMPERATURE]; top_k is 0 or -1 (off) or in [1, MAX_TOP_K]; 0 < top_p <= 1 (1 = off); 0 <= min_p < 1 (0 = off);
      seed is None or an int in [0, 2**64); max_tokens >= 1; stop_token_ids ints >= 0;
      logprobs / prompt_logprobs are None (not returned) or a top-n count in [0, 100]
      (0 = only the sampled / target token's log-prob).
    Logit processors (vLLM's, in its order; all off by default): logit_bias (token id >= 0 ->
      bias in [-100, 100], added), allowed_token_ids (non-empty; every other token -inf),
      bad_words_token_ids (non-empty sequences; a sequence's last token is -inf when the output
      ends with the rest of it), min_tokens (0 <= min_tokens <= max_tokens; EOS and
      stop_token_ids are -inf until that many tokens are generated), repetition_penalty (> 0,
      1 = off; HF's: a token seen in the prompt or the output has logit / p if > 0 else * p),
      presence_penalty and frequency_penalty (in [-2, 2]; OpenAI's, over the output only:
      logit -= presence * (count > 0) + frequency * count).
    cache_salt: None or a string of at most 256 characters; requests with different salts never
      share prefix-cache blocks (vLLM's `cache_salt`, SGLang's `extra_key`).
    prefix_cache_policy: None (the engine's `InferenceConfig.prefix_cache_policy`) or a
      `PrefixCachePolicy`: RESET matches only blocks the current weights computed; SALTED keys
      the request's blocks by its group's (or session's) start version.
    session_id: None or a string of at most 256 characters: the multi-turn session the request is
      a turn of; under SALTED every turn is keyed by the session's start version.
    lora_name: None (the base model) or the name of a loaded LoRA adapter (1 to 256 characters);
      the request runs on the adapter's version current when it is added, to its end (PIN).
    structured_outputs: None or a `StructuredOutputs` (a dict of its fields is taken too): the
      completion must match it (JSON schema, regex, choice, grammar; see structured.py). The
      engine compiles it against its tokenizer when the request is added; its token mask is the
      first processor.
    Processors act on the raw logits; then the truncations apply in the order temperature ->
    top-k -> top-p -> min-p (see sampler.py).
    """

    n: Annotated[int, Meta(ge=1, le=MAX_SAMPLES)] = 1
    temperature: Annotated[float, Meta(ge=0, le=MAX_TEMPERATURE)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=MAX_TOP_K)] = 0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    min_p: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    seed: NonNegInt | None = None
    max_tokens: Annotated[int, Meta(ge=1)] = 16
    stop_token_ids: Annotated[list[NonNegInt], Meta(max_length=MAX_STOP_TOKENS)] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: _TopN | None = None
    prompt_logprobs: _TopN | None = None
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    # MoE models: return the experts each token was routed to, per MoE layer (routing replay in the
    # trainer); such a request computes its whole prompt (no prefix-cache hit skips a route)
    return_routed_experts: bool = False
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0
    presence_penalty: _Penalty = 0.0
    frequency_penalty: _Penalty = 0.0
    min_tokens: NonNegInt = 0
    logit_bias: Annotated[dict[NonNegInt, _Bias], Meta(max_length=MAX_TOKEN_IDS)] | None = None
    bad_words_token_ids: Annotated[list[_TokenSequence], Meta(max_length=MAX_BAD_WORDS)] | None = None
    allowed_token_ids: Annotated[list[NonNegInt], Meta(min_length=1, max_length=MAX_TOKEN_IDS)] | None = None
    cache_salt: Annotated[str, Meta(max_length=MAX_CACHE_SALT_LENGTH)] | None = None
    prefix_cache_policy: PrefixCachePolicy | None = None
    session_id: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_LENGTH)] | None = None
    structured_outputs: StructuredOutputs | None = None
    # False: this request never speculates, even on an engine configured to (InferenceConfig.speculative)
    speculative: bool = True
    lora_name: Annotated[str, Meta(min_length=1, max_length=MAX_LORA_NAME_LENGTH)] | None = None

    def __post_init__(self) -> None:
        if not (_is_int(self.n) and self.n >= 1):
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not (_is_real(self.temperature) and math.isfinite(self.temperature)
                and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE)):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature!r}")
        if not (_is_int(self.top_k) and (1 <= self.top_k <= MAX_TOP_K or self.top_k in (0, -1))):
            raise ValueError(f"top_k must be 0 or -1 (off) or an int in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if not (_is_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_real(self.min_p) and 0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop_token_ids, list):
            if not isinstance(self.stop_token_ids, tuple):
                raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        for tok in self.stop_token_ids:
            if not (_is_int(tok) and tok >= 0):
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {tok!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        _check_top_n("logprobs", self.logprobs)
        _check_top_n("prompt_logprobs", self.prompt_logprobs)
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts must be a bool, got {self.return_routed_experts!r}")
        if not isinstance(self.logprobs_mode, LogprobsMode):
            raise ValueError(f"logprobs_mode must be a LogprobsMode, got {self.logprobs_mode!r}")
        self._check_processors()

    def _check_processors(self) -> None:
        if not (_is_real(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), "
                             f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_real(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be None or a dict of token id -> bias, got {self.logit_bias!r}")
            for tok, bias in self.logit_bias.items():
                if not (_is_int(tok) and tok >= 0):
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {tok!r}")
                if not (_is_real(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                    raise ValueError(f"logit_bias values must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                     f"got {bias!r} for token {tok}")
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, (list, tuple)):
                raise ValueError(f"bad_words_token_ids must be None or a list of token-id lists, "
                                 f"got {self.bad_words_token_ids!r}")
            if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words_token_ids may hold at most {MAX_BAD_WORDS} sequences, "
                                 f"got {len(self.bad_words_token_ids)}")
            self.bad_words_token_ids = [_check_token_list("bad_words_token_ids", seq, allow_empty=False)
                                        for seq in self.bad_words_token_ids]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_list("allowed_token_ids", self.allowed_token_ids, allow_empty=False)
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str)
                                                and len(self.cache_salt) <= MAX_CACHE_SALT_LENGTH):
            raise ValueError(f"cache_salt must be None or a string of at most {MAX_CACHE_SALT_LENGTH} characters, "
                             f"got {self.cache_salt!r:.80}")
        if self.prefix_cache_policy is not None:
            try:
                self.prefix_cache_policy = PrefixCachePolicy(self.prefix_cache_policy)
            except ValueError:
                raise ValueError(f"prefix_cache_policy must be None or one of {[p.value for p in PrefixCachePolicy]}, "
                                 f"got {self.prefix_cache_policy!r:.80}") from None
        if self.session_id is not None and not (isinstance(self.session_id, str)
                                                and 1 <= len(self.session_id) <= MAX_CACHE_SALT_LENGTH):
            raise ValueError(f"session_id must be None or a string of 1 to {MAX_CACHE_SALT_LENGTH} characters, "
                             f"got {self.session_id!r:.80}")
        if self.lora_name is not None and not (isinstance(self.lora_name, str)
                                               and 1 <= len(self.lora_name) <= MAX_LORA_NAME_LENGTH):
            raise ValueError(f"lora_name must be None or a string of 1 to {MAX_LORA_NAME_LENGTH} characters, "
                             f"got {self.lora_name!r:.80}")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs must be None or a StructuredOutputs, "
                             f"got {self.structured_outputs!r:.80}")

    @property
    def greedy(self) -> bool:
        """True when sampling is a deterministic argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def uses_processors(self) -> bool:
        """True when any logit processor is on (penalties, min_tokens, bias, bad words, allowed ids)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.logit_bias) or bool(self.bad_words_token_ids)
                or self.allowed_token_ids is not None)
