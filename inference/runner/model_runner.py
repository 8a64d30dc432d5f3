"""ModelRunner: prepare inputs -> run the model -> sample, over persistent buffers.

A fixed pipeline per step. The inputs go into buffers sized once at start (`InputBuffers`), so
no step allocates them and the model always sees the same tensors. With buckets configured, each
step is padded to the bucket of its shape (`BucketPolicy`: decode-only steps by requests, mixed
steps by tokens); an expert-parallel rank pads to the bucket its group agreed on and, with no
requests, runs a dummy batch of it. With `cuda_graphs`, the model is captured once per bucket
(`cuda_graphs.PiecewiseGraphs`) and replayed; steps past the largest bucket run eagerly. The model
computes logits only for the rows that are sampled or scored. The sampler and its float32
workspace live here; on suspend the scratch areas (the sampler's, attention's) and the CUDA graphs
with their memory pool are released, and resume captures the graphs again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch

from inference.cache.manager import CacheManager
from inference.config import InferenceConfig
from inference.lora import LoRAAdapter, LoRABatch
from inference.models import small_gemm
from inference.models.protocol import StateBatch
from inference.runner.buckets import IDLE, BatchDims, BucketPolicy
from inference.runner.cuda_graphs import PiecewiseGraphs
from inference.runner.inputs import InputBuffers, StepInputs, fill_dummy_inputs, fill_inputs
from inference.sampling.batch import SamplingBatch
from inference.sampling.sampler import Sampler, SamplerOutput
from inference.sched.context import DynamicInferenceContext
from inference.sched.scheduler import StepPlan


class ModelRunner:
    """Runs one model over the flat batches the scheduler plans (see module docstring).

    Invariant: `buffers` are allocated once; `prepare` only writes into them. Graphs, when
    captured, match the model's current weight addresses (`weights_changed` re-captures).
    """

    def __init__(self, model: Any, caches: CacheManager, config: InferenceConfig,
                 lora_adapter: Optional[Callable[[int], LoRAAdapter]] = None) -> None:
        self.model = model
        self.lora_adapter = lora_adapter  # resident adapter id -> its tensors (the LoRA registry's)
        self.caches = caches
        if config.batch_invariant:
            check_batch_invariant(model)
        self.batch_invariant = config.batch_invariant  # NOTE: the fp32 products in fixed order at any row count
        self.buckets = BucketPolicy(config.batch_buckets, config.decode_buckets)
        max_tokens = max(config.max_batch_tokens, config.largest_bucket)
        self.buffers = InputBuffers(max_tokens, config.max_blocks_per_request, caches.kv.device)
        self.sampler = Sampler()
        self.routes = getattr(model, "routes", None)  # MoE models record their routing here
        if self.routes is not None:
            self.routes.ensure(max_tokens)
        self.graphs = PiecewiseGraphs(model, self.buffers, self.buckets.sizes) if config.cuda_graphs else None
        if self.graphs is not None:
            self.graphs.capture_all()
        self.last_bucket: Optional[int] = None
        self.graph_replays = self.eager_steps = 0

    # ---- shapes ------------------------------------------------------------------------------

    def local_dims(self, plan: StepPlan) -> BatchDims:
        return IDLE if plan.empty else BatchDims.of_plan(plan.query_lens, plan.num_decode)

    def match_bucket(self, dims: BatchDims) -> Optional[int]:
        """The padded size of a step of `dims`, or None (eager, unpadded)."""
        return self.buckets.match(dims) if self.caches.scratch_block is not None else None

    # ---- a step ------------------------------------------------------------------------------

    def prepare(self, ctx: DynamicInferenceContext, plan: StepPlan, dims: Optional[BatchDims] = None) -> StepInputs:
        """Write `plan`'s step into the buffers, padded to the bucket of `dims` (default: the
        plan's own; an expert-parallel rank passes the dims its group agreed on)."""
        self.last_bucket = self.match_bucket(dims if dims is not None else self.local_dims(plan))
        states = self.caches.states
        return fill_inputs(self.buffers, ctx, plan, padded=self.last_bucket, scratch_block=self.caches.scratch_block,
                           scratch_state=None if states is None else states.scratch)

    def prepare_dummy(self, dims: BatchDims) -> StepInputs:
        """A batch of the agreed shape without requests (scratch block only; no logits)."""
        self.last_bucket = self.match_bucket(dims)
        states = self.caches.states
        return fill_dummy_inputs(self.buffers, self.last_bucket or 1, self.caches.block_size,
                                 self.caches.scratch_block, scratch_state=None if states is None else states.scratch)

    def prepare_verify(self, ctx: DynamicInferenceContext, plan: StepPlan) -> StepInputs:
        """A speculative verify step's inputs, unpadded: it runs eagerly (`forward(eager=True)`)."""
        self.last_bucket = None
        return fill_inputs(self.buffers, ctx, plan)

    def forward(self, inputs: StepInputs, *, eager: bool = False) -> torch.Tensor:
        """Logits for `inputs.logits_indices` (padding rows, if any, come last). With
        `inputs.record_routes`, an MoE model also writes each token's experts (`routes_of`).
        `eager`: never replay a CUDA graph (they are captured for one token per decode)."""
        if self.routes is not None:
            self.routes.active = inputs.record_routes
        # NOTE: a step with adapters runs eagerly: its row groups change from step to step
        if not eager and inputs.lora_ids is None and self.graphs is not None and self.graphs.has(inputs.padded_tokens):
            self.graph_replays += 1
            return self.graphs.replay(inputs, self.caches.kv)
        self.eager_steps += 1
        kwargs: dict[str, Any] = {}
        if inputs.state_slots is not None:
            kwargs["states"] = self._state_batch(inputs)
        if inputs.lora_ids is not None:
            kwargs["lora"] = LoRABatch(inputs.lora_ids, inputs.logits_rows, self.lora_adapter,
                                       inputs.input_ids.device, small_gemm.linear if self.batch_invariant else None)
        if self.batch_invariant:  # NOTE: nothing added to a default step
            with small_gemm.fixed_order():
                return self.model.forward(inputs.input_ids, inputs.positions, self.caches.kv, inputs.meta,
                                          inputs.logits_indices, **kwargs)
        return self.model.forward(inputs.input_ids, inputs.positions, self.caches.kv, inputs.meta,
                                  inputs.logits_indices, **kwargs)

    def _state_batch(self, inputs: StepInputs) -> StateBatch:
        return StateBatch(self.caches.states.tensors, inputs.state_slots, inputs.state_fresh, inputs.num_decode,
                          inputs.verify)

    def advance_states(self, inputs: StepInputs, kept: np.ndarray) -> None:
        """After the verify forward of `inputs` (a stateful model's): each request's state moves over
        its first `kept[b]` verify rows, the tokens it keeps."""
        self.model.advance_states(self._state_batch(inputs), kept.tolist())

    def routes_of(self, inputs: StepInputs) -> np.ndarray:
        """The experts of the step's real tokens: `[tokens, moe_layers, k]` (after `forward`)."""
        return self.routes.buffer[:, : inputs.num_tokens].permute(1, 0, 2).cpu().numpy()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sampler(logits, batch)

    # ---- memory and weights ------------------------------------------------------------------

    def release_workspace(self) -> int:
        """Drop the sampler's and attention's scratch buffers and the CUDA graphs (suspend); the
        bytes of the scratch buffers (the graphs' pool shows in the measured memory)."""
        if self.graphs is not None:
            self.graphs.release()
        return self.sampler.release() + self.model.backend.release_workspace()

    def reacquire(self) -> None:
        """After resume: capture the CUDA graphs again."""
        if self.graphs is not None:
            self.graphs.capture_all()

    def weights_changed(self) -> None:
        """Weights were rebound (new addresses) or copied in place: graphs follow the former."""
        if self.graphs is not None:
            self.graphs.check_weights()

    def stats(self) -> dict:
        out = {"eager_steps": self.eager_steps, "graph_replays": self.graph_replays}
        if self.graphs is not None:
            out.update(self.graphs.stats())
        return out


def check_batch_invariant(model: Any) -> None:
    """`InferenceConfig.batch_invariant`'s refusals: what its fixed-order kernels do not cover yet."""
    from inference import native
    from inference.models.dense.decoder import DenseDecoder
    from inference.models.moe.decoder import MoeDecoder

    if not isinstance(model, DenseDecoder) or isinstance(model, MoeDecoder):
        raise ValueError(f"batch_invariant: {type(model).__name__} is not covered yet (the dense decoder is: "
                         "Llama, Mistral, Qwen2, Qwen3); hybrid and MoE models mix rows in their own kernels")
    if not native.available():
        raise ValueError("batch_invariant needs the native kernels (ROLLOUT_ENGINE_NO_KERNELS is set, or they did "
                         "not build): the torch paths' products and attention follow the batch's shape")
