"""One request's life in the engine, and what the caller gets back.

A `Request` carries everything that must survive a pause, an eviction or a suspend: its prompt,
the tokens it generated with their log-probs and policy versions. While it runs, its tokens also
sit in the context's per-slot buffers (the hot copy); the request object is brought up to date
whenever it leaves its slot.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from inference.sampling.params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token or EOS was sampled
    LENGTH = "length"  # max_tokens or max_sequence_length reached
    ABORT = "abort"  # aborted by the caller, or by a pause / suspend / weight update under ABORT
    STALE = "stale"  # started more than max_staleness versions ago (StalePolicy.ABORT): not to train on


SHARED_CLIENT = ""  # the client of every request submitted without one (see inference.sched.waiting)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; not in a slot (new, evicted, or to be recomputed)
    RUNNING = "running"  # in a slot: prefilling or decoding
    PAUSED = "paused"  # in a slot, keeps its blocks, waits for a free block
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """Bookkeeping of one sample. `group_size > 1` samples of one prompt share its prefill."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    group_id: int
    sample_index: int = 0
    group_size: int = 1
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    generated_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    top_logprobs: Optional[list[dict[int, float]]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    prompt_logprob_ranks: Optional[list[Optional[int]]] = None  # see RequestOutput
    generator: Optional[torch.Generator] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    finish_reason: Optional[FinishReason] = None
    stream_tokens: bool = False  # its caller wants each token as it is sampled, not only the end
    client: str = SHARED_CLIENT  # who submitted it: admission takes turns between clients
    admitted: bool = False  # has held a slot (a pause in WAIT mode lets only these run on)
    # sibling requests that wait for this one's prompt prefill to fork from it (sample 0 only)
    fork_children: list[Request] = field(default_factory=list)
    # while it leads a queued group: what a later request must match to join it (`Scheduler.new_group`)
    prefill_key: Optional[tuple] = None
    num_preemptions: int = 0
    cached_tokens: Optional[int] = None  # prompt tokens the prefix cache served at its first admission
    # the version it (its group, its session) started under; what max_staleness measures, and under
    # the SALTED prefix-cache policy (`salted`) the version its blocks are keyed by
    start_version: int = 0
    salted: bool = False
    hash_cache_key: Optional[tuple[int, int]] = None  # (key version, token count) of hash_cache
    hash_cache: list[int] = field(default_factory=list)
    # prompt log-probs by position while in a slot (a `PromptScores`; `prompt_logprobs` is built
    # from it when the request leaves its slot)
    prompt_scores: Optional[Any] = None
    # MoE routing by token position `[max_total_tokens, moe_layers, k]` (return_routed_experts)
    routed_experts: Optional[np.ndarray] = None
    # structured outputs: the compiled grammar (an llguidance template matcher, never advanced;
    # each slot the request takes gets its own copy), None when unconstrained
    grammar: Optional[Any] = None
    # the LoRA adapter version it is pinned to (an `inference.lora.AdapterRef`), None: the base model
    lora: Optional[Any] = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.generated_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.generated_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """One token of a streamed request, sent as soon as it is sampled (`index` 0 = first token)."""

    request_id: int
    sample_index: int
    index: int
    token_id: int
    logprob: float
    version: int


@dataclass(slots=True)
class RequestOutput:
    """A finished request: plain data, safe to ship to another process."""

    request_id: int
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: FinishReason
    top_logprobs: Optional[list[dict[int, float]]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    # each prompt token's rank in the vocabulary where it was scored (vLLM's: the entries whose
    # log-prob is >= its own; 1 = most likely, ties count ahead), None for the first token
    prompt_logprob_ranks: Optional[list[Optional[int]]] = None
    group_id: int = 0
    sample_index: int = 0
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache served (first admission)
    # the experts each computed token went to: `[num_tokens - 1, moe_layers, k]` (the last sampled
    # token was never fed to the model); None unless `return_routed_experts`
    routed_experts: Optional[np.ndarray] = None
    lora_version: Optional[int] = None  # the LoRA adapter version that sampled every token (None: the base model)

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> Optional[float]:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @classmethod
    def from_request(cls, req: Request) -> RequestOutput:
        assert req.finish_reason is not None
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            generated_token_ids=req.generated_token_ids,
            logprobs=req.logprobs,
            token_versions=req.token_versions,
            finish_reason=req.finish_reason,
            top_logprobs=req.top_logprobs,
            prompt_logprobs=req.prompt_logprobs,
            prompt_logprob_ranks=req.prompt_logprob_ranks,
            group_id=req.group_id,
            sample_index=req.sample_index,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            num_preemptions=req.num_preemptions,
            cached_tokens=req.cached_tokens or 0,
            routed_experts=None if req.routed_experts is None else req.routed_experts[: req.num_tokens - 1],
            lora_version=None if req.lora is None else req.lora.version,
        )
