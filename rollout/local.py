"""RolloutEngine: what a colocated RL loop talks to (the in-process `RolloutBackend`).

It wraps one `DynamicInferenceEngine` and speaks in token lists and `RolloutBatch`es: n samples per
prompt, each with its per-token log-probs and policy versions. Trainer coupling (suspend / resume,
weight aliasing, version bumps) is passed through to the engine, which owns the state machine.
`rollout.RolloutClient` is the same interface to an engine in another process.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from inference import DynamicInferenceEngine, InferenceConfig, RequestOutput, SamplingParams, TokenEvent, UpdatePolicy
from inference.lora import AdapterRef
from inference.weights.adapters import WeightAdapter
from rollout.backend import Prompts, params_per_prompt, sort_rollouts
from rollout.client.weights import WeightSyncCalls
from rollout.collector import SampleCollector
from rollout.control import SOURCE_TYPES, Read, WeightSource
from rollout.service.engine_service import HEALTH_DEADLINE_S, EngineService
from rollout.text import TextCodec, add_text, has_tokenizer, needs_codec, token_prompts
from rollout.types import GenerationStats, Rollout, RolloutBatch, TokenChunk
from rollout.wire.messages import RequestMessage, Result, kind_of
from weight_sync import WeightReceiver

logger = logging.getLogger(__name__)


class LocalSampleStream:
    """The samples of one `RolloutEngine.stream` call (see `rollout.backend.SampleStream`).

    Without a background loop, the thread that iterates steps the engine (other callers' requests
    progress too). Past its deadline the running samples are aborted and `TimeoutError` raised.
    """

    def __init__(self, engine: DynamicInferenceEngine, prompts: Prompts, params: list[SamplingParams],
                 tokens: bool, timeout: Optional[float], codec: Optional[TextCodec] = None) -> None:
        self._engine = engine
        self._codec = codec
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        streams = engine.submit_many(prompts, params, stream_tokens=tokens, callback=self._items.put)
        self._group = {rid: g for g, s in enumerate(streams) for rid in s.request_ids}
        # NOTE: the engine's request ids are its samples' (one sample each): the collector's requests
        self.collector = SampleCollector([rid for s in streams for rid in s.request_ids], [1] * len(self._group),
                                         timeout)
        self.request_ids = self.collector.request_ids
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}

    def __iter__(self) -> Iterator[Union[Rollout, TokenChunk]]:
        return self

    def __next__(self) -> Union[Rollout, TokenChunk]:
        while True:
            if self.collector.done:
                raise StopIteration
            try:
                item = self._items.get(timeout=0.05) if self._engine.loop_running else self._items.get_nowait()
            except queue.Empty:
                self._wait()
                continue
            group = self._group[item.request_id]
            if isinstance(item, TokenEvent):
                return TokenChunk(group, item.sample_index, item.index, [item.token_id], [item.logprob],
                                  [item.version])
            if not self.collector.take(self._index[item.request_id], 0):
                continue
            rollout = _rollout(item, group)
            add_text([rollout], self._codec)
            return rollout

    def _wait(self) -> None:
        if self.collector.expired():
            self.abort()
            self.collector.give_up()
            raise TimeoutError(f"stream of {len(self._group)} samples not done within {self.collector.timeout} s; "
                               "its running samples were aborted")
        if not self._engine.loop_running:
            self._engine.step_for_waiter()

    def result(self, timeout: Optional[float] = None) -> list[Rollout]:
        self.collector.within(timeout)
        return sort_rollouts(item for item in self if isinstance(item, Rollout))

    def abort(self) -> None:
        pending = self.collector.unfinished()
        if pending:
            self._engine.abort_many(pending)


def _rollout(out: RequestOutput, group: int) -> Rollout:
    return Rollout(
        prompt_ids=list(out.prompt_token_ids),
        completion_ids=list(out.generated_token_ids),
        logprobs=list(out.logprobs),
        versions=list(out.token_versions),
        finish_reason=out.finish_reason,
        group=group,
        sample_index=out.sample_index,
        top_logprobs=out.top_logprobs,
        routed_experts=out.routed_experts,
        prompt_logprobs=out.prompt_logprobs,
        prompt_logprob_ranks=out.prompt_logprob_ranks,
        cached_tokens=out.cached_tokens,
        lora_version=out.lora_version,
    )


class RolloutEngine(WeightSyncCalls):
    """n samples per prompt from one engine replica that shares the trainer's process and memory.

    Implements `rollout.RolloutBackend`, with every control call of a client (`rollout.control`:
    pause, suspend, weight updates from any `weight_sync` source, LoRA adapters, health) answered by
    the engine service (`rollout.service.engine_service`) as a server's engine answers it.

    Safe to call from several threads at once: each `generate` receives exactly its own samples.
    Prompts may be token ids, strings or chat message lists; text needs a tokenizer: `tokenizer=`
    (a directory, an HF tokenizer or a `TextCodec`), else the model directory's own, loaded when
    the first text prompt comes. Once a tokenizer is there, every `Rollout` carries its `text`.
    """

    def __init__(
        self,
        model_or_path: Union[str, Path, torch.nn.Module],
        config: Optional[InferenceConfig] = None,
        *,
        share_weights: bool = True,
        tokenizer: Any = None,
    ) -> None:
        self.config = config or InferenceConfig()
        self.engine = DynamicInferenceEngine.from_pretrained(model_or_path, self.config, share_weights=share_weights)
        self._codec = None if tokenizer is None else TextCodec.load(tokenizer)
        self._tokenizer_dir = model_or_path if isinstance(model_or_path, (str, Path)) else None
        self.service = self._new_service()
        self._ids = itertools.count()

    def _new_service(self) -> EngineService:
        # NOTE: a receiver starts its threads on first use, so an engine that never takes weights has none
        return EngineService(self.engine, WeightReceiver(self.engine), HEALTH_DEADLINE_S)

    @property
    def codec(self) -> Optional[TextCodec]:
        """The tokenizer (loaded from the model directory on first use); None without one."""
        if self._codec is None and self._tokenizer_dir is not None and has_tokenizer(self._tokenizer_dir):
            self._codec = TextCodec.load(self._tokenizer_dir)
        return self._codec

    def _token_prompts(self, prompts: Any) -> Any:
        return token_prompts(prompts, self.codec if needs_codec(prompts) else None)

    # ---- generation --------------------------------------------------------------------------

    def generate(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
                 timeout: Optional[float] = None, session_id: Optional[str] = None,
                 group_id: Optional[str] = None) -> RolloutBatch:
        """Sample `n` completions of every prompt; returns them grouped by prompt, in prompt order.
        (`session_id` / `group_id`: a router's hints, see `RolloutBackend.generate`; one engine ignores them.)

        `sampling.n` is replaced by `n`. A seeded `sampling` gives prompt i the seed `seed + i` (the
        engine mixes seed and sample index into each sample's stream), so a call is reproducible
        whatever the batch's scheduling.
        Log-probs are the engine's RAW ones (log-softmax of the logits) unless `sampling` says
        otherwise: what a trainer recomputes for importance ratios.
        """
        prompts = self._token_prompts(prompts)
        params = params_per_prompt(len(prompts), n, sampling)
        eng = self.engine
        version = eng.policy_version
        pool_before, steps_before = eng.allocator.stats(), eng.num_steps
        start = time.perf_counter()
        outputs = eng.generate(prompts, params, timeout=timeout)
        seconds = time.perf_counter() - start
        pool_after = eng.allocator.stats()
        first_group = outputs[0].group_id if outputs else 0
        rollouts = [_rollout(o, o.group_id - first_group) for o in outputs]
        add_text(rollouts, self._codec)
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

    def stream(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
               tokens: bool = False, timeout: Optional[float] = None, session_id: Optional[str] = None,
               group_id: Optional[str] = None) -> LocalSampleStream:
        """The samples of `generate(prompts, n, sampling)`, each as it finishes (tokens as sampled)."""
        prompts = self._token_prompts(prompts)
        return LocalSampleStream(self.engine, prompts, params_per_prompt(len(prompts), n, sampling), tokens, timeout,
                                 self._codec)

    def abort(self, stream: LocalSampleStream) -> None:
        stream.abort()

    # ---- control (`rollout.control`): the engine service answers, in this thread ----------

    def _next_id(self, prefix: str = "c") -> str:
        return f"local-{prefix}{next(self._ids)}"

    def _control(self, msg: RequestMessage, timeout: Optional[float], read: Read) -> Any:
        """Answered by the engine service as a server's engine answers it; without a background loop
        this thread steps the engine while the call waits on it (a WAIT pause's drain). An engine
        error is raised as the engine raised it."""
        fields = self.engine.settle(self.service.handle(msg), timeout)
        return read(Result(request_id=msg.request_id, request_kind=kind_of(type(msg)),
                           policy_version=self.engine.policy_version, **fields))

    def abort_requests(self, targets: Sequence[int], *, timeout: Optional[float] = None) -> None:
        """Finish the engine's requests `targets` (a `LocalSampleStream`'s `request_ids`) now."""
        self.engine.abort_many(list(targets))

    # ---- trainer coupling (the engine owns the state machine) --------------------------------

    def bind_trainer_model(self, module: torch.nn.Module, adapter: Optional[WeightAdapter] = None) -> Any:
        """Alias `module`'s parameters (no copy; another layout than HF's through its `adapter`,
        megatron-core's: `weight_sync.MEGATRON_ADAPTER`); returns the bind report (aliased / copied
        names)."""
        return self.engine.bind_trainer_model(module, adapter)

    def load_lora_from_peft(self, name: str, peft_model: Any, *, share: bool = False) -> AdapterRef:
        """Adapter `name`'s next version from a live PEFT model: copied, or with `share` aliased
        (colocated: zero copy, the trainer's in-place steps show through; see the engine's method)."""
        return self.engine.load_lora_from_peft(name, peft_model, share=share)

    def on_weights_updated(self) -> int:
        """The aliased parameters changed in place: bump the version, drop the prefix cache."""
        return self.engine.on_weights_updated()

    def update_weights(self, source: WeightSource, version: Optional[int] = None, *,
                       policy: Optional[UpdatePolicy] = None, timeout: Optional[float] = None,
                       partial: bool = False, adapter: Optional[WeightAdapter] = None) -> int:
        """Copy weights in (not aliased): a safetensors directory (checked against its manifest and
        checksums where it has them) or a `weight_sync` source, through the engine's weight receiver
        as a server's; or named tensors, straight into the engine (`partial`: only some of them;
        `adapter`: another layout's names). The new version."""
        if not isinstance(source, (str, os.PathLike, *SOURCE_TYPES)):
            return self.engine.update_weights(source, version, policy=None if policy is None else UpdatePolicy(policy),
                                              partial=partial, adapter=adapter)
        if partial or adapter is not None:
            raise ValueError("partial and adapter apply to named tensors; a directory or a weight_sync source says "
                             "its own names and layout")
        return super().update_weights(source, version, policy=policy, timeout=timeout)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def state(self) -> Any:
        return self.engine.state

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Stop the engine's background loop if one runs and the weight receiver's threads. The
        engine itself stays usable: a later call that needs a receiver gets a fresh one."""
        self.engine.stop()
        self.service.receiver.close()
        self.service = self._new_service()
