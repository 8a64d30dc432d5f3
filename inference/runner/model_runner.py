"""ModelRunner: prepare inputs -> run the model -> sample, over persistent buffers.

A fixed pipeline per step. The inputs go into buffers sized once at start (`InputBuffers`), so
no step allocates them and the model always sees the same tensors; with `batch_buckets` set,
batches are padded to a few shapes (what CUDA graphs will replay). The model computes logits only
for the rows that are sampled or scored. The sampler and its float32 workspace live here; both
scratch areas (the sampler's and attention's) are released on suspend.
"""

from __future__ import annotations

from typing import Any

import torch

from inference.cache.manager import CacheManager
from inference.config import InferenceConfig
from inference.models.protocol import StateBatch
from inference.runner.inputs import InputBuffers, StepInputs, fill_inputs
from inference.sampling import Sampler, SamplerOutput, SamplingBatch
from inference.sched.context import DynamicInferenceContext
from inference.sched.scheduler import StepPlan


class ModelRunner:
    """Runs one model over the flat batches the scheduler plans (see module docstring).

    Invariant: `buffers` are allocated once; `prepare` only writes into them.
    """

    def __init__(self, model: Any, caches: CacheManager, config: InferenceConfig) -> None:
        self.model = model
        self.caches = caches
        self.buckets = config.batch_buckets
        self.buffers = InputBuffers(config.max_batch_tokens if not self.buckets else
                                    max(config.max_batch_tokens, max(self.buckets)),
                                    config.max_blocks_per_request, caches.kv.device)
        self.sampler = Sampler()

    def prepare(self, ctx: DynamicInferenceContext, plan: StepPlan) -> StepInputs:
        states = self.caches.states
        return fill_inputs(self.buffers, ctx, plan, buckets=self.buckets, scratch_block=self.caches.scratch_block,
                           scratch_state=None if states is None else states.scratch)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits for `inputs.logits_indices` (padding rows, if any, come last)."""
        states = None
        if inputs.state_slots is not None:
            states = StateBatch(self.caches.states.tensors, inputs.state_slots, inputs.state_fresh, inputs.num_decode)
        kwargs = {} if states is None else {"states": states}
        return self.model.forward(inputs.input_ids, inputs.positions, self.caches.kv, inputs.meta,
                                  inputs.logits_indices, **kwargs)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sampler(logits, batch)

    def release_workspace(self) -> int:
        """Drop the sampler's and attention's scratch buffers (suspend); their bytes."""
        return self.sampler.release() + self.model.backend.release_workspace()

