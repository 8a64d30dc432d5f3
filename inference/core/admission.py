"""The checks a request passes before the engine queues it, as functions of what they read: its
prompt's tokens, its processors' token ids, whether it can ever fit, and the waiting queue's room.
Each raises the typed error the caller reports (`ValueError` naming the field for bad input)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from inference.config import InferenceConfig
from inference.errors import BlockOverflowError, MaxSequenceLengthOverflowError, OverloadedError, RequestOverflowError
from inference.sampling.params import SamplingParams


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The prompt as a list of ints, each inside the vocabulary."""
    if isinstance(prompt_token_ids, (torch.Tensor, np.ndarray)):
        prompt_token_ids = prompt_token_ids.tolist()
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
        raise ValueError(f"prompt_token_ids must be a sequence of ints, got {type(prompt_token_ids).__name__}")
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError("prompt_token_ids must not be empty")
    for tok in prompt:
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise ValueError(f"prompt_token_ids must hold ints, got {tok!r}")
        if not 0 <= tok < vocab_size:
            raise ValueError(f"prompt_token_ids: token {tok} is outside the vocabulary of {vocab_size}")
    return [int(t) for t in prompt]


def check_processors(params: SamplingParams, vocab_size: int) -> None:
    """The processors' token ids must lie in the vocabulary (as vLLM checks them)."""
    named = [("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())]
    named += [("bad_words_token_ids", seq) for seq in params.bad_words_token_ids or ()]
    for name, ids in named:
        for tok in ids:
            if tok >= vocab_size:
                raise ValueError(f"{name}: token {tok} is outside the vocabulary of {vocab_size}")


def check_fits(prompt: list[int], params: SamplingParams, cfg: InferenceConfig, total_blocks: int) -> None:
    """A request that can never fit (its length, its blocks at full length, its samples) is refused with
    a permanent typed error."""
    total = len(prompt) + params.max_tokens
    if total > cfg.max_sequence_length:
        raise MaxSequenceLengthOverflowError(
            None, f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) > max_sequence_length "
            f"({cfg.max_sequence_length})"
        )
    blocks = -(-total // cfg.block_size)
    if blocks > total_blocks:
        raise BlockOverflowError(
            None, f"needs {blocks} KV blocks at full length; the pool has {total_blocks}",
            is_transient=False,
        )
    if params.n > cfg.max_requests:
        raise RequestOverflowError(
            None, f"n={params.n} samples exceed max_requests={cfg.max_requests}", is_transient=False
        )


def check_room(samples: int, cfg: InferenceConfig, waiting: int) -> None:
    """Refuse `samples` samples (prompts x n, all of one call) with `waiting` samples queued: more than one
    request may ask for (`ValueError`), or more than the waiting queue has room for now (`OverloadedError`:
    retry once it drained)."""
    if samples > cfg.max_samples_per_request:
        raise ValueError(f"max_samples_per_request: the request asks for {samples} samples (prompts x n); "
                         f"this engine takes at most {cfg.max_samples_per_request} in one request")
    if waiting + samples > cfg.max_waiting_samples:
        raise OverloadedError(f"overloaded: {waiting} samples wait for a slot and {samples} more would pass "
                              f"max_waiting_samples={cfg.max_waiting_samples}; retry later")
