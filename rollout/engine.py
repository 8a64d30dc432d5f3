"""RolloutEngine: what a colocated RL loop talks to.

It wraps one `DynamicInferenceEngine` and speaks in token lists and `RolloutBatch`es: n samples per
prompt, each with its per-token log-probs and policy versions. Trainer coupling (suspend / resume,
weight aliasing, version bumps) is passed through to the engine, which owns the state machine.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from rollout.types import GenerationStats, Rollout, RolloutBatch

logger = logging.getLogger(__name__)

class RolloutEngine:
    """n samples per prompt from one engine replica that shares the trainer's process and memory.

    Safe to call from several threads at once: each `generate` receives exactly its own samples.
    """

    def __init__(
        self,
        model_or_path: Union[str, Path, torch.nn.Module],
        config: Optional[InferenceConfig] = None,
        *,
        share_weights: bool = True,
    ) -> None:
        self.config = config or InferenceConfig()
        self.engine = DynamicInferenceEngine.from_pretrained(model_or_path, self.config, share_weights=share_weights)

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int = 1, sampling: Optional[SamplingParams] = None
    ) -> RolloutBatch:
        """Sample `n` completions of every prompt; returns them grouped by prompt, in prompt order.

        `sampling.n` is replaced by `n`. A seeded `sampling` gives prompt i the seed `seed + i` (the
        engine mixes seed and sample index into each sample's stream), so a call is reproducible
        whatever the batch's scheduling.
        Log-probs are the engine's RAW ones (log-softmax of the logits) unless `sampling` says
        otherwise: what a trainer recomputes for importance ratios.
        """
        base = sampling or SamplingParams()
        params = [
            dataclasses.replace(base, n=n, seed=None if base.seed is None else (base.seed + i) % 2**64)
            for i in range(len(prompts))
        ]
        eng = self.engine
        version = eng.policy_version
        pool_before, steps_before = eng.allocator.stats(), eng.num_steps
        start = time.perf_counter()
        outputs = eng.generate(prompts, params)
        seconds = time.perf_counter() - start
        pool_after = eng.allocator.stats()
        first_group = outputs[0].group_id if outputs else 0
        rollouts = [
            Rollout(
                prompt_ids=list(o.prompt_token_ids),
                completion_ids=list(o.generated_token_ids),
                logprobs=list(o.logprobs),
                versions=list(o.token_versions),
                finish_reason=o.finish_reason,
                group=o.group_id - first_group,
                sample_index=o.sample_index,
            )
            for o in outputs
        ]
        hits = pool_after.hit_blocks - pool_before.hit_blocks
        stats = GenerationStats(
            seconds=seconds,
            engine_steps=eng.num_steps - steps_before,
            prompt_tokens=sum(len(p) for p in prompts),  # NOTE: a group's prompt is prefilled once
            completion_tokens=sum(len(r.completion_ids) for r in rollouts),
            peak_kv_utilization=eng.peak_kv_utilization(steps_before),
            prefix_hit_blocks=hits,
            prefix_lookup_blocks=hits + pool_after.miss_blocks - pool_before.miss_blocks,
        )
        return RolloutBatch(rollouts, group_size=n, policy_version=version, stats=stats)

    # ---- trainer coupling (the engine owns the state machine) --------------------------------

    def suspend(self, **kwargs: Any) -> Any:
        """Free the KV buffer for the trainer; returns the engine's `SuspendReport`."""
        return self.engine.suspend(**kwargs)

    def resume(self) -> None:
        self.engine.resume()

    def bind_trainer_model(self, module: torch.nn.Module) -> Any:
        """Alias `module`'s parameters (no copy); returns the bind report (aliased / copied names)."""
        return self.engine.bind_trainer_model(module)

    def on_weights_updated(self) -> int:
        """The aliased parameters changed in place: bump the version, drop the prefix cache."""
        return self.engine.on_weights_updated()

    def update_weights(
        self, named_tensors: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
        version: Optional[int] = None, **kwargs: Any,
    ) -> int:
        """Copy weights in (not aliased); returns the new policy version."""
        return self.engine.update_weights(named_tensors, version, **kwargs)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def state(self) -> Any:
        return self.engine.state

    def stats(self) -> dict:
        return self.engine.stats()

