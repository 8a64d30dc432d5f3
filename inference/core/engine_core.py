"""EngineCore: owns one engine's parts and steps them; every state change goes through it.

The parts, each the only writer of its state: the `Scheduler` (live requests, waiting queue,
groups, reservations, preemption), the context (slots, token buffers, block tables), the
`CacheManager` (KV buffer with its block allocator and prefix cache, per-request state pool), the
`ModelRunner` (persistent inputs, the model's forward, the sampler) and the `WeightManager`
(policy version, trainer binding, staged updates). Suspend / resume is the core asking each part
to release and re-acquire what it holds (`sleep.py`); a request's checks before it queues are
`admission.py`'s.

The core is single-threaded: its client (`DynamicInferenceEngine`) serialises every call. It
keeps no outputs: each finished request goes to `on_finished` and each streamed token to
`on_tokens` the moment it exists, whichever call (step, abort, pause, suspend, update) made it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from inference.cache.manager import CacheManager
from inference.config import InferenceConfig, PauseMode, SuspendedAddPolicy, SuspendPolicy, UpdatePolicy
from inference.core import admission
from inference.core import outputs as out_ops
from inference.core.ep_step import ExpertParallelSteps
from inference.core.memory import SuspendReport
from inference.core.sleep import Sleep
from inference.core.speculative_step import SpeculativeSteps
from inference.core.states import EngineState, MemoryTag, OnFinished, OnTokens
from inference.core.stats import core_stats
from inference.errors import (
    EngineStateError,
    StaleSessionError,
    TensorStateDeallocatedError,
    WeightNameError,
    WeightsUnavailableError,
)
from inference.kv_cache.policy import PrefixCachePolicy
from inference.lora import AdapterInfo, AdapterRef, LoRAAdapter, LoRARegistry
from inference.lora.offload import AdapterOffload
from inference.request import SHARED_CLIENT, Request, RequestOutput
from inference.runner.model_runner import ModelRunner
from inference.sampling.grammar import GrammarCompiler
from inference.sampling.params import SamplingParams
from inference.sampling.seeds import make_generator, sample_seed
from inference.sched.block_registration import register_full_blocks
from inference.sched.context import DynamicInferenceContext
from inference.sched.scheduler import Scheduler
from inference.sched.staleness import enforce_staleness
from inference.weights.adapters import WeightAdapter
from inference.weights.manager import NamedTensors, WeightManager
from inference.weights.staging import Staging

logger = logging.getLogger(__name__)

KV_TRACE_STEPS = 1 << 14  # steps of blocks-in-use history kept for peak-utilisation queries


class EngineCore:
    """One model replica's parts and its state machine (see module docstring).

    States: RUNNING steps; PAUSED (by `pause(mode)`) steps only in WAIT mode and only what was
    admitted; SUSPENDED holds no KV buffer. `resume()` returns to the state `suspend()` left, or to
    the one a `pause()` / `continue_()` while suspended asked for.
    """

    def __init__(self, model: Any, config: InferenceConfig, on_finished: OnFinished, on_tokens: OnTokens) -> None:
        self.config = config
        self.model = model
        self._on_finished = self._finished_then(on_finished)
        self._on_tokens = on_tokens
        spec = model.spec
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = np.array(sorted(spec.eos_token_ids), dtype=np.int64)
        self.weights = WeightManager(model)
        self.loras = LoRARegistry(config.max_loras, config.max_lora_rank, config.lora_max_staleness)
        self.lora_offload = AdapterOffload()  # the adapters' tensors while the weights sleep
        # NOTE: padding rows and expert-parallel dummy steps write their K/V into a scratch block
        self.caches = CacheManager(model.cache_specs(), config, model.device,
                                   scratch_block=config.batch_buckets is not None
                                   or getattr(model, "expert_parallel", None) is not None)
        self.kv_cache = self.caches.kv
        self.allocator = self.caches.allocator
        self.context = DynamicInferenceContext(config, self.allocator, lambda: self.weights.policy_version,
                                               self.caches.states, self.caches.snapshots,
                                               vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids.tolist())
        self.grammars = GrammarCompiler(config.tokenizer, self.vocab_size, self.eos_token_ids.tolist())
        self.scheduler = Scheduler(self.context)
        self.runner = ModelRunner(model, self.caches, config, self.loras.adapter)
        # NOTE: None keeps the step exactly as without speculation (one attribute test per step)
        self.speculation = None if config.speculative is None else SpeculativeSteps(self, config.speculative)
        self.state = EngineState.RUNNING
        self.pause_mode: Optional[PauseMode] = None
        self._before_suspend: tuple[EngineState, Optional[PauseMode]] = (EngineState.RUNNING, None)
        self.sleep = Sleep(self)  # the parts asleep, and what a suspend took to host
        self.num_steps = 0
        self.generated_tokens = 0
        self.stale_aborted = self.stale_restarted = 0  # samples handled by max_staleness
        self.ep: Optional[ExpertParallelSteps] = None  # set on an expert-parallel rank
        # blocks in use during each step (ring buffer), sampled before finished requests release
        self._kv_trace = np.zeros(KV_TRACE_STEPS, dtype=np.int32)

    # ---- requests ----------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Sequence[int], params: Optional[SamplingParams]) -> tuple[
            list[int], SamplingParams]:
        """Validate a request without changing anything; returns the normalised prompt and params.

        Bad input raises `ValueError` naming the field; a request that can never fit raises the
        typed permanent error; while suspended (policy RAISE) a transient error.
        """
        if self.state is EngineState.SUSPENDED and self.config.suspended_add_policy is SuspendedAddPolicy.RAISE:
            raise TensorStateDeallocatedError(None, "the engine is suspended; add requests after resume()")
        if self.weights.serving_error is not None:
            error = WeightsUnavailableError if self.weights.awaits_update else EngineStateError
            raise error(f"the engine cannot generate now: {self.weights.serving_error}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        prompt = admission.validate_prompt(prompt_token_ids, self.vocab_size)
        for tok in params.stop_token_ids:
            if tok >= self.vocab_size:
                raise ValueError(f"stop_token_ids: {tok} is outside the vocabulary of {self.vocab_size}")
        admission.check_processors(params, self.vocab_size)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # NOTE: cached: add_checked takes it again
        if params.session_id is not None and params.session_id in self.scheduler.salts.stale:
            raise StaleSessionError(f"session_id {params.session_id!r} started more than max_staleness="
                                    f"{self.config.max_staleness} policy versions ago (stale_policy abort); "
                                    f"end it and start a new session")
        if params.lora_name is not None and params.lora_name not in self.loras:
            self.loras.current(params.lora_name)  # raises the typed LoRANotFoundError
        if params.return_routed_experts and self.runner.routes is None:
            raise ValueError("return_routed_experts: this model has no experts (only MoE models record routes)")
        admission.check_fits(prompt, params, self.config, self.allocator.total)
        return prompt, params

    def check_room(self, samples: int) -> None:
        """Refuse a request of `samples` samples (prompts x n, all of one call) that passes the
        admission bounds, changing nothing (`admission.check_room`)."""
        admission.check_room(samples, self.config, self.scheduler.num_waiting_samples)

    def add_checked(self, prompt: list[int], params: SamplingParams, *, stream_tokens: bool = False,
                    client: str = SHARED_CLIENT) -> list[int]:
        """Queue a request that `check_request` (and `check_room`) accepted, in `client`'s lane;
        returns one id per sample."""
        group_id, ids = self.scheduler.next_ids(params.n)
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        samples = [
            Request(rid, prompt, params, group_id, index, params.n, stream_tokens=stream_tokens, client=client,
                    generator=None if params.seed is None else make_generator(sample_seed(params.seed, index)),
                    grammar=grammar)
            for index, rid in enumerate(ids)
        ]
        if params.lora_name is not None:  # NOTE: each sample pinned to the version current now (PIN)
            for req in samples:
                req.lora = self.loras.pin(params.lora_name, req.request_id)
        self.scheduler.new_group(samples)
        return ids

    def _finished_then(self, on_finished: OnFinished) -> OnFinished:
        """`on_finished`, after the request's adapter pin is dropped (every finish passes here)."""
        def finished(output: RequestOutput) -> None:
            self.loras.release(output.request_id)
            on_finished(output)
        return finished

    # ---- LoRA adapters -----------------------------------------------------------------------

    def add_lora(self, adapter: LoRAAdapter, version: Optional[int] = None) -> AdapterRef:
        """Make a checked adapter the current version of its name (`version`, None: the next one);
        requests in flight keep theirs."""
        return self.loras.add(adapter, version)

    def remove_lora(self, name: str) -> None:
        """Unload `name` (`LoRANotFoundError`, or `LoRAInUseError` while requests use it)."""
        self.loras.remove(name)

    def lora_infos(self) -> list[AdapterInfo]:
        return self.loras.infos()

    def abort(self, request_id: int) -> bool:
        """Finish a request now with reason `abort` (partial tokens kept); False if unknown/done."""
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._on_finished(RequestOutput.from_request(req))
        return req is not None

    def abort_all(self) -> int:
        """Abort every live request (outputs go to `on_finished`); how many there were."""
        aborted = self.scheduler.abort_all()
        for req in aborted:
            self._on_finished(RequestOutput.from_request(req))
        return len(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def can_step(self) -> bool:
        """Whether a step could make progress now (there is work and the state lets it run); an
        expert-parallel rank also steps while its peers work, and for heartbeats."""
        if self.ep is not None:
            return self.ep.wants_step()
        if self.weights.serving_error is not None:
            return False
        if self.state is EngineState.RUNNING:
            return self.scheduler.has_unfinished_requests()
        return self.state is EngineState.PAUSED and self.pause_mode is PauseMode.WAIT and self.scheduler.in_flight()

    # ---- the step ----------------------------------------------------------------------------

    def set_ep_communicator(self, communicator: Any, *, heartbeat_s: float = 0.01) -> None:
        """Make this engine a rank of an expert-parallel group: every step agrees on its batch shape
        with the peers over `communicator` (an `EPCommunicator`), see `core/ep_step.py`.

        NOTE: the lockstep itself works for any model (a dense one keeps it for tests and for
        attention-only ranks); an MoE model loaded with `expert_parallel` needs it, since its
        exchanges hang unless every rank runs every step."""
        if communicator.world_size > 1 and self.caches.scratch_block is None:
            raise EngineStateError("set_ep_communicator: dummy steps need a scratch KV block; load the model "
                                   "with expert_parallel=ExpertParallel(...) or configure batch_buckets")
        self.ep = ExpertParallelSteps(self, communicator, heartbeat_s=heartbeat_s)

    def step(self) -> None:
        """One forward pass over the scheduled requests; outputs go to the client's callbacks."""
        if self.ep is not None:
            self.ep.step()
            return
        if not self.can_step():
            return
        plan = self.scheduler.schedule(admit_new=self.state is EngineState.RUNNING)
        if plan.empty:
            return
        if self.speculation is not None:  # NOTE: it runs the plan, as a verify step or plainly
            self.speculation.step(plan)
            return
        self.run_plan(plan, self.runner.prepare(self.context, plan))

    def run_plan(self, plan: Any, batch: Any) -> None:
        """Forward the prepared `batch` of `plan`, then forks, block registration, sampling."""
        ctx = self.context
        try:
            logits = self.runner.forward(batch)
        except Exception:
            self.allocator.events.discard_pending()
            raise
        if batch.record_routes:  # NOTE: before forks copy a leader's prompt routes to its samples
            out_ops.record_routes(ctx, batch, self.runner.routes_of(batch))
        self.count_step()
        ctx.kv_len[plan.slots] += plan.query_lens
        ctx.prefill_tokens += batch.prompt_tokens
        if batch.prompt_rows:  # NOTE: before registration caches them with their blocks
            out_ops.record_prompt_logprobs(ctx, batch, logits)
        forks = self.scheduler.fork_groups(batch.sample_slots)
        self.caches.copy_for_forks(forks.kv_copies, forks.state_copies)
        # NOTE: forked samples have nothing to register: their full blocks are the parent's
        register_full_blocks(ctx, plan.slots)
        ctx.snapshot_states(plan.slots[plan.num_decode :])  # models with state: the Mamba side of the cache
        self.allocator.events.publish_pending()
        slots = forks.slots
        if slots.size:  # NOTE: a step of mid-prompt chunks only samples nothing
            # NOTE: sampled rows come first in the logits; without forks a view, not a copy
            rows = logits[: slots.size] if forks.rows is None else logits[forks.rows]
            out = self.runner.sample(rows, out_ops.sampling_batch(ctx, slots))
            self.commit_tokens(slots, out)

    def count_step(self) -> None:
        """A forward ran: record the blocks in use during it, count the step."""
        self._kv_trace[self.num_steps % KV_TRACE_STEPS] = self.allocator.active
        self.num_steps += 1

    def commit_tokens(self, slots: np.ndarray, out: Any) -> None:
        """Append one sampled token per slot (`out` row i for `slots[i]`); stream and finish."""
        ctx = self.context
        tokens, logprobs = out.token_ids.numpy(), out.logprobs.numpy()
        self.generated_tokens += slots.size
        if out.top_logprobs is not None:
            out_ops.record_top_logprobs(ctx, slots, out)
        events = out_ops.token_events(ctx, slots, tokens, logprobs)  # NOTE: before slots are released
        finished = ctx.update_requests(slots, tokens, logprobs)
        if events:
            self._on_tokens(events)
        for req, reason in finished:
            self.scheduler.finish(req, reason)
            if self.speculation is not None:
                self.speculation.finished(req)
            self._on_finished(RequestOutput.from_request(req))

    # ---- pause / continue --------------------------------------------------------------------

    def pause(self, mode: PauseMode) -> None:
        """Stop generating (see `PauseMode`); new requests queue until `continue_()`."""
        mode = PauseMode(mode)
        if mode is PauseMode.ABORT:
            self.abort_all()
        elif mode is PauseMode.RETRACT and self.state is not EngineState.SUSPENDED:
            self.scheduler.requeue_in_slot_requests()
        if self.state is EngineState.SUSPENDED:  # NOTE: as vLLM, accepted asleep; it holds after the wake-up
            self._before_suspend = (EngineState.PAUSED, mode)
        else:
            self.state, self.pause_mode = EngineState.PAUSED, mode

    def continue_(self) -> None:
        """Generate again after `pause()`; a no-op while running. Asleep, the engine generates again
        once it wakes up (vLLM's `/resume` of a sleeping engine answers 200 too)."""
        if self.state is EngineState.SUSPENDED:
            self._before_suspend = (EngineState.RUNNING, None)
        else:
            self.state, self.pause_mode = EngineState.RUNNING, None

    def drained(self) -> bool:
        """Nothing admitted is still in flight (what a WAIT pause waits for)."""
        return not self.scheduler.in_flight()

    # ---- suspend / resume --------------------------------------------------------------------

    def suspend(self, policy: Optional[SuspendPolicy] = None, *, offload_weights: bool = False,
                tags: Optional[Collection[str]] = None, discard_weights: bool = False) -> SuspendReport:
        """Free memory for a colocated trainer, by part (`Sleep.suspend`); the first part to sleep
        suspends the engine, which resumes to the state it left (or that a pause asked for since)."""
        if not self.sleep.asleep:
            self._before_suspend = (self.state, self.pause_mode)
        report = self.sleep.suspend(policy, offload_weights=offload_weights, tags=tags,
                                    discard_weights=discard_weights)
        if self.sleep.asleep:
            self.state = EngineState.SUSPENDED
        return report

    @property
    def asleep(self) -> set[MemoryTag]:
        """The `MEMORY_TAGS` suspended now (`Sleep.asleep`)."""
        return self.sleep.asleep

    def resume(self, tags: Optional[Collection[str]] = None) -> None:
        """Re-allocate what suspend freed, by part (`Sleep.resume`); generation goes on once no part
        sleeps. `EngineStateError` for a `resume()` of all while nothing sleeps."""
        if not self.sleep.asleep and tags is None:
            raise EngineStateError(f"resume() without suspend(): the engine is {self.state.value}")
        if self.sleep.resume(tags) and not self.sleep.asleep:
            self.state, self.pause_mode = self._before_suspend

    # ---- weights -----------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.weights.policy_version

    def reset_prefix_cache(self) -> None:
        """Nothing cached so far can be matched again, even blocks requests still hold."""
        self.caches.reset_prefix_cache()  # KV blocks and state snapshots
        self.context.break_hash_chains()

    def bind_trainer_model(self, module: Any, adapter: Optional[WeightAdapter] = None) -> Any:
        report = self.weights.bind_trainer_model(module, adapter)
        self.runner.weights_changed()
        self.reset_prefix_cache()
        return report

    def on_weights_updated(self, policy: Optional[UpdatePolicy] = None) -> int:
        """The aliased weights changed in place: new version, prefix cache reset."""
        self.weights.refresh_from_trainer()
        self._apply_update_policy(policy)
        version = self.weights.commit_version()
        self._version_changed()
        return version

    def update_weights(self, named_tensors: NamedTensors, version: Optional[int] = None, *,
                       policy: Optional[UpdatePolicy] = None, partial: bool = False,
                       adapter: Optional[WeightAdapter] = None) -> int:
        """Copy new weights in (HF or megatron-core names); commit them under a new version.

        Everything is checked before a byte is copied: on a typed error nothing changed.
        """
        hf = self.weights.prepare_update(named_tensors, partial=partial, adapter=adapter)
        self.weights.check_version(version)
        self._apply_update_policy(policy)
        self.weights.apply_update(hf)
        self.runner.weights_changed()
        version = self.weights.commit_version(version)
        self._version_changed()
        return version

    def begin_update(self, version: Optional[int] = None, staging: Staging = Staging.DOUBLE, *,
                     partial: bool = False, retain_staging: bool = False, origin: str = "",
                     held: bool = False) -> None:
        """Open a staged update (see `WeightManager`); `load_weights` buckets, then commit / abort."""
        self.weights.begin_update(version, staging, partial=partial, retain_staging=retain_staging, origin=origin,
                                  held=held)

    def load_weights(self, named_tensors: NamedTensors, adapter: Optional[WeightAdapter] = None) -> int:
        return self.weights.load(named_tensors, adapter)

    def staging_buffers(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return self.weights.staging_buffers(names)

    def commit_update(self, policy: Optional[UpdatePolicy] = None) -> int:
        """The staged weights go live: in-flight requests follow `policy`, the version changes and
        the prefix cache resets, once."""
        missing = self.weights.missing_from_update()
        if missing:  # NOTE: checked before the policy touches anything in flight
            raise WeightNameError(f"commit: {len(missing)} tensors not loaded, e.g. {missing[:8]}")
        self._apply_update_policy(policy)
        version = self.weights.commit_update()
        self.runner.weights_changed()
        self._version_changed()
        return version

    def _version_changed(self) -> None:
        """A new version is live: too-stale work goes first (before anything is prefilled again),
        then the blocks no request may read any more: all of them under RESET when no salted user
        is left (the classic reset), else the versions nobody is salted with (RESET) or those past
        `max_staleness` (SALTED; the ones without a live user become the first to evict)."""
        cfg = self.config
        if cfg.max_staleness is not None:
            aborted, restarted = enforce_staleness(self.scheduler, cfg.max_staleness, cfg.stale_policy)
            self.stale_aborted += len(aborted)
            self.stale_restarted += restarted
            for req in aborted:
                self._on_finished(RequestOutput.from_request(req))
        live = self.scheduler.salts.live_versions()
        if cfg.prefix_cache_policy is PrefixCachePolicy.RESET and not live:
            self.reset_prefix_cache()
            return
        current = self.policy_version
        cached = set(self.allocator.blocks_by_version())
        if cfg.prefix_cache_policy is PrefixCachePolicy.RESET:
            drop = cached - live
        else:
            drop = {v for v in cached if cfg.max_staleness is not None and v < current - cfg.max_staleness}
            self.allocator.demote_key_versions(cached - drop - live - {current})
        self.allocator.drop_key_versions(drop)
        ctx = self.context
        # NOTE: an unsalted chain is keyed by the version it began under: it may not grow under another
        ctx.break_hash_chains([s for s in ctx.active + ctx.paused
                               if not ctx.requests[s].salted or ctx.requests[s].start_version in drop])

    def end_session(self, session_id: str) -> bool:
        """A session's trajectory is over: it no longer keeps its version's blocks; whether it was known."""
        return self.scheduler.end_session(session_id)

    def abort_update(self) -> None:
        self.weights.abort_update()

    def _apply_update_policy(self, policy: Optional[UpdatePolicy]) -> None:
        policy = UpdatePolicy(policy or self.config.update_policy)
        if policy is UpdatePolicy.ABORT:
            self.abort_all()
        elif policy is UpdatePolicy.RECOMPUTE:
            self.scheduler.requeue_in_slot_requests()
        # KEEP: requests go on with their KV; their next tokens carry the new version

    # ---- introspection -----------------------------------------------------------------------

    def kv_utilization(self) -> float:
        """Fraction of KV blocks held by requests now (cheap: two counters)."""
        return self.allocator.active / self.allocator.total

    def peak_kv_utilization(self, since_step: int) -> float:
        """Largest fraction of blocks in use during any step since `since_step` (counted while the
        step ran, before its finished requests gave their blocks back)."""
        first = max(since_step, self.num_steps - KV_TRACE_STEPS)
        if first >= self.num_steps:
            return 0.0
        idx = np.arange(first, self.num_steps) % KV_TRACE_STEPS
        return float(self._kv_trace[idx].max()) / self.allocator.total

    def stats(self) -> dict:
        """Counters and settings by name (`stats.core_stats`)."""
        return core_stats(self)
