"""What an RL loop gets back from the rollout engine: plain data, plus one tensor view.

`Rollout` is one sample (a prompt's completion); `RolloutBatch` is the samples of one `generate`
call, the n samples of a prompt contiguous. Everything here is lists of ints and floats, so a batch
can be serialised (msgpack, no pickle) or shipped elsewhere; torch appears only in `to_padded_tensors`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from inference.request import FinishReason

__all__ = ["FinishReason", "GenerationStats", "PaddedBatch", "Rollout", "RolloutBatch", "TokenChunk"]


@dataclass(slots=True)
class Rollout:
    """One sampled completion.

    Invariants: `completion_ids`, `logprobs` and `versions` have one entry per generated token;
    `logprobs[i]` is the engine's log-prob (raw, temperature 1) of `completion_ids[i]` and
    `versions[i]` the policy version that sampled it; `group` indexes the prompt in its batch.
    `top_logprobs` (when asked for) holds one {token id: log-prob} per token; `prompt_logprobs`
    (when asked for) one entry per prompt token, the first None (nothing predicts it), each
    {prompt token: log-prob, top alternatives...}, and `prompt_logprob_ranks` each prompt token's
    rank in the vocabulary (vLLM's: entries with a log-prob >= its own; the first None); `text` is
    the completion decoded from `completion_ids` when the backend has a tokenizer.
    `routed_experts` (MoE, `return_routed_experts`): `[positions fed, moe layers, k]` expert ids,
    for the trainer's routing replay.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    group: int
    sample_index: int = 0
    top_logprobs: Optional[list[dict[int, float]]] = None
    text: Optional[str] = None
    routed_experts: Optional[np.ndarray] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    prompt_logprob_ranks: Optional[list[Optional[int]]] = None
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served for this sample
    # the LoRA adapter version that sampled it (PIN: one for all its tokens); None: the base model
    lora_version: Optional[int] = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"Rollout: completion_ids ({n}), logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have one entry per token"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(slots=True)
class TokenChunk:
    """Tokens one sample generated since its previous chunk, while it runs (token streaming).

    `start` indexes the first of them in the sample's completion; the sample's final `Rollout`
    holds every token again, so a consumer may skip chunks.
    """

    group: int
    sample_index: int
    start: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass(slots=True)
class GenerationStats:
    """Figures of one `generate` call, measured by the engine wrapper (not estimated)."""

    seconds: float = 0.0
    engine_steps: int = 0
    prompt_tokens: int = 0  # distinct prompt tokens: a group of n prefills its prompt once
    completion_tokens: int = 0
    peak_kv_utilization: float = 0.0  # max over engine steps of the fraction of KV blocks in use
    prefix_hit_blocks: int = 0
    prefix_lookup_blocks: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_blocks / self.prefix_lookup_blocks if self.prefix_lookup_blocks else 0.0


@dataclass(slots=True)
class PaddedBatch:
    """Right-padded `[B, T]` tensors for a policy-gradient loss.

    Every tensor is aligned with `input_ids` (prompt then completion, then padding): position t of
    `loss_mask`, `old_logprobs` and `versions` describes token t, which the model predicts from
    positions < t. `loss_mask` is True exactly on completion tokens; `old_logprobs` is 0 elsewhere
    and `versions` -1.
    """

    input_ids: torch.Tensor  # int64
    attention_mask: torch.Tensor  # int64, 1 on real tokens
    loss_mask: torch.Tensor  # bool
    old_logprobs: torch.Tensor  # float32
    versions: torch.Tensor  # int64

    def to(self, device: torch.device | str) -> PaddedBatch:
        return PaddedBatch(*(t.to(device) for t in (
            self.input_ids, self.attention_mask, self.loss_mask, self.old_logprobs, self.versions)))


@dataclass(slots=True)
class RolloutBatch:
    """The samples of one `generate` call, in prompt order, a prompt's n samples together.

    `group_size` is the n asked for; `policy_version` the engine's version when generation began.
    """

    rollouts: list[Rollout]
    group_size: int
    policy_version: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)

    @classmethod
    def of_served(cls, rollouts: list[Rollout], prompts: Sequence[Sequence[int]], n: int, seconds: float,
                  version_now: Callable[[], int]) -> RolloutBatch:
        """A served engine's answer to one call: under the oldest version any of its tokens was
        sampled under (`version_now()`, asked only if none was sampled)."""
        stats = GenerationStats(seconds=seconds, prompt_tokens=sum(len(p) for p in prompts),
                                completion_tokens=sum(len(r.completion_ids) for r in rollouts))
        versions = [v for r in rollouts for v in r.versions]
        return cls(rollouts, group_size=n, policy_version=min(versions) if versions else version_now(), stats=stats)

    def __len__(self) -> int:
        return len(self.rollouts)

    def __iter__(self) -> Iterator[Rollout]:
        return iter(self.rollouts)

    def __getitem__(self, index: int) -> Rollout:
        return self.rollouts[index]

    @property
    def num_groups(self) -> int:
        return len({r.group for r in self.rollouts})

    @property
    def groups(self) -> list[int]:
        return [r.group for r in self.rollouts]

    @property
    def completion_lengths(self) -> list[int]:
        return [len(r.completion_ids) for r in self.rollouts]

    @property
    def versions(self) -> set[int]:
        """Every policy version that sampled a token of this batch."""
        return {v for r in self.rollouts for v in r.versions}

    def to_padded_tensors(
        self, pad_id: int = 0, device: Optional[torch.device | str] = None, max_length: Optional[int] = None
    ) -> PaddedBatch:
        """Right-padded tensors of prompt + completion (see `PaddedBatch`); T = the longest sample.

        Right padding keeps every real token at its own position (0..len-1), so a causal model
        needs no position ids and its predictions for real tokens do not see the padding.
        """
        if not self.rollouts:
            raise ValueError("to_padded_tensors: the batch is empty")
        length = max(r.num_tokens for r in self.rollouts)
        if max_length is not None and length > max_length:
            raise ValueError(f"to_padded_tensors: a sample has {length} tokens > max_length={max_length}")
        b = len(self.rollouts)
        input_ids = torch.full((b, length), pad_id, dtype=torch.int64)
        attention_mask = torch.zeros((b, length), dtype=torch.int64)
        loss_mask = torch.zeros((b, length), dtype=torch.bool)
        old_logprobs = torch.zeros((b, length), dtype=torch.float32)
        versions = torch.full((b, length), -1, dtype=torch.int64)
        for row, r in enumerate(self.rollouts):
            p, n = len(r.prompt_ids), r.num_tokens
            input_ids[row, :n] = torch.tensor(r.prompt_ids + r.completion_ids, dtype=torch.int64)
            attention_mask[row, :n] = 1
            if n > p:
                loss_mask[row, p:n] = True
                old_logprobs[row, p:n] = torch.tensor(r.logprobs, dtype=torch.float32)
                versions[row, p:n] = torch.tensor(r.versions, dtype=torch.int64)
        batch = PaddedBatch(input_ids, attention_mask, loss_mask, old_logprobs, versions)
        return batch if device is None else batch.to(device)


def group_slices(groups: Sequence[int]) -> list[tuple[int, int]]:
    """`[start, end)` of each run of equal group indices (the batch keeps groups contiguous)."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(groups) + 1):
        if i == len(groups) or groups[i] != groups[start]:
            out.append((start, i))
            start = i
    return out
