"""Per-request sampling parameters, validated once at construction.

`SamplingParams` is created for every request, so validation is a handful of plain comparisons
(no tensors, no copies beyond normalising `stop_token_ids` to a list). Every error is a
`ValueError` whose message starts with the offending field's name.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 100  # the largest top-n a request may ask for (sampled or prompt log-probs)
# NOTE: the sampler keeps temperatures in float32 and takes 1 / T: below MIN_TEMPERATURE 1 / T
# overflows (0 * inf = NaN at the max logit), above MAX_TEMPERATURE sampling is uniform anyway;
# top_k lives in an int64 tensor and is cut to the vocabulary, so anything above int32 is a bug.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6
MAX_TOP_K = 2**31 - 1


class LogprobsMode(enum.IntEnum):
    """Which distribution the returned log-probs are taken from.

    RAW: `log_softmax` of the model's raw logits, exactly what a trainer recomputes; the default,
    because importance ratios and KL terms compare against it.
    PROCESSED: the distribution actually sampled from, after temperature, top-k, top-p and min-p
    (tokens cut away have log-prob -inf). Greedy rows use temperature 1 here.
    """

    RAW = 0
    PROCESSED = 1


def _is_int(value: object) -> bool:
    # NOTE: bool is an int subclass; `top_k=True` is a bug in the caller, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    The truncations apply in the order temperature -> top-k -> top-p -> min-p (see sampler.py).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    # MoE models: return the experts each token was routed to, per MoE layer (routing replay in the
    # trainer); such a request computes its whole prompt (no prefix-cache hit skips a route)
    return_routed_experts: bool = False

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
        _check_top_n("logprobs", self.logprobs)
        _check_top_n("prompt_logprobs", self.prompt_logprobs)
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts must be a bool, got {self.return_routed_experts!r}")
        if not isinstance(self.logprobs_mode, LogprobsMode):
            raise ValueError(f"logprobs_mode must be a LogprobsMode, got {self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling is a deterministic argmax (temperature 0)."""
        return self.temperature == 0
