"""DynamicInferenceEngine: in-flight batching over a paged, prefix-cached KV pool.

One `step()` = schedule -> build the flat batch -> forward -> sample -> update bookkeeping.
Requests may be added or aborted between any two steps; `generate()` drives steps until its
own requests are done.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from inference.config import InferenceConfig, SuspendedAddPolicy
from inference.context import DynamicInferenceContext
from inference.coupling import TrainerCoupling
from inference.errors import (
    BlockOverflowError,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    TensorStateDeallocatedError,
)
from inference.kv_cache.allocator import KVBlockAllocator
from inference.kv_cache.events import KVEventHub
from inference.request import FinishReason, Request, RequestOutput, RequestStatus
from inference.sampling import Sampler, SamplingBatch, compute_prompt_logprobs, make_generator
from inference.sampling_params import SamplingParams
from inference.scheduler import Scheduler
from inference.step_batch import build_step_batch

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    RUNNING = "running"
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    RESUMING = "resuming"


class DynamicInferenceEngine(TrainerCoupling):
    """Serves many requests at once on one model replica, next to its trainer.

    Invariants: every request added is, at any time, exactly one of waiting, in a slot
    (running or paused), or finished (its output returned by exactly one `step()`). Steps run
    only while RUNNING; suspend/resume and weight updates live in `TrainerCoupling`.
    """

    def __init__(self, model: Any, config: Optional[InferenceConfig] = None) -> None:
        self.config = config or InferenceConfig()
        if self.config.max_tokens < self.config.max_requests:
            raise ValueError(
                f"InferenceConfig.max_tokens ({self.config.max_tokens}) must be >= max_requests "
                f"({self.config.max_requests}): every running request decodes one token per step"
            )
        self.model = model
        spec = model.spec
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = np.array(sorted(spec.eos_token_ids), dtype=np.int64)
        bytes_per_block = (
            2 * spec.num_layers * self.config.block_size * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        )
        num_blocks = self.config.resolve_num_blocks(bytes_per_block)
        self.kv_cache = model.new_kv_cache(num_blocks, self.config.block_size)
        self.allocator = KVBlockAllocator(
            num_blocks,
            self.config.block_size,
            self.config.eviction_policy,
            self.config.enable_prefix_caching,
            KVEventHub(record=self.config.record_kv_events),
        )
        self.context = DynamicInferenceContext(self.config, self.allocator)
        self.scheduler = Scheduler(self.context)
        self.sampler = Sampler()
        self.state = EngineState.RUNNING
        self._ids = itertools.count()
        self._groups = itertools.count()
        self._live: dict[int, Request] = {}  # every request not yet returned, by id
        self._unclaimed: list[RequestOutput] = []  # finished outside the caller's view (abort)
        self.num_steps = 0
        self.generated_tokens = 0
        self._offloaded_kv = None
        self._offloaded_weights: list = []
        self._bound_trainer_tensors: list[torch.Tensor] = []  # the trainer's tensors the model aliases
        self._trainer_refresh = None  # rewrites tensors an adapter had to convert (see bind_trainer_model)

    @classmethod
    def from_pretrained(
        cls,
        model: Union[str, Path, torch.nn.Module],
        config: Optional[InferenceConfig] = None,
        *,
        share_weights: bool = False,
    ) -> DynamicInferenceEngine:
        """Build from an HF model directory or an in-memory transformers `*ForCausalLM`."""
        from inference.models.loading import load_from_hf_dir, load_from_hf_model

        config = config or InferenceConfig()
        if isinstance(model, (str, Path)):
            decoder = load_from_hf_dir(model, dtype=config.dtype, device=config.device)
        else:
            decoder = load_from_hf_model(model, share_weights=share_weights, dtype=config.dtype, device=config.device)
        engine = cls(decoder, config)
        report = getattr(decoder, "bind_report", None)
        if share_weights and report is not None:
            params = dict(model.named_parameters(remove_duplicate=False))
            engine._bound_trainer_tensors = [params[n] for n in report.aliased]
        return engine

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: Sequence[int], sampling_params: Optional[SamplingParams] = None
    ) -> Union[int, list[int]]:
        """Queue a prompt; returns its request id, or one id per sample when `n` > 1.

        Bad input raises `ValueError` naming the field; a request that can never fit raises
        the typed permanent error. Either way nothing already in the engine is touched.
        """
        if self.state is not EngineState.RUNNING and self.config.suspended_add_policy is SuspendedAddPolicy.RAISE:
            raise TensorStateDeallocatedError(None, f"the engine is {self.state.value}; add requests after resume()")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        prompt = self._validate_prompt(prompt_token_ids)
        for tok in params.stop_token_ids:
            if tok >= self.vocab_size:
                raise ValueError(f"stop_token_ids: {tok} is outside the vocabulary of {self.vocab_size}")
        self._check_fits(prompt, params)
        group_id = next(self._groups)
        samples = []
        for index in range(params.n):
            generator = None if params.seed is None else make_generator((params.seed + index) % 2**64)
            samples.append(Request(next(self._ids), prompt, params, group_id, index, params.n, generator=generator))
        head = samples[0]
        head.fork_children = samples[1:]
        for req in samples:
            self._live[req.request_id] = req
        self.scheduler.add(head)
        ids = [r.request_id for r in samples]
        return ids[0] if params.n == 1 else ids

    def _validate_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
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
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"prompt_token_ids: token {tok} is outside the vocabulary of {self.vocab_size}")
        return [int(t) for t in prompt]

    def _check_fits(self, prompt: list[int], params: SamplingParams) -> None:
        cfg = self.config
        total = len(prompt) + params.max_tokens
        if total > cfg.max_sequence_length:
            raise MaxSequenceLengthOverflowError(
                None, f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) > max_sequence_length "
                f"({cfg.max_sequence_length})"
            )
        blocks = -(-total // cfg.block_size)
        if blocks > self.allocator.total:
            raise BlockOverflowError(
                None, f"needs {blocks} KV blocks at full length; the pool has {self.allocator.total}",
                is_transient=False,
            )
        if params.n > cfg.max_requests:
            raise RequestOverflowError(
                None, f"n={params.n} samples exceed max_requests={cfg.max_requests}", is_transient=False
            )

    def abort(self, request_id: int) -> bool:
        """Finish a request now with reason `abort` (partial tokens kept); False if unknown/done."""
        req = self._live.get(request_id)
        if req is None:
            return False
        ctx, sched = self.context, self.scheduler
        if req.status is RequestStatus.WAITING:
            if req in sched.waiting:
                sched.waiting.remove(req)
                if req.fork_children:  # the siblings still need their prompt: the first one leads
                    lead, rest = req.fork_children[0], req.fork_children[1:]
                    lead.fork_children, req.fork_children = rest, []
                    sched.add(lead, front=True)
            else:  # a sibling waiting for its group's prefill
                for head in itertools.chain(sched.waiting, (r for r in ctx.requests if r is not None)):
                    if req in head.fork_children:
                        head.fork_children.remove(req)
                        if head.status is not RequestStatus.WAITING:
                            sched.reserved_slots -= 1
                        break
        else:
            slot = ctx.requests.index(req)
            ctx.release_memory_blocks_from_request_indexes([slot])
            if req.fork_children:
                sched.reserved_slots -= len(req.fork_children)
                lead, rest = req.fork_children[0], req.fork_children[1:]
                lead.fork_children, req.fork_children = rest, []
                sched.add(lead, front=True)
        self._finish(req, FinishReason.ABORT)
        self._unclaimed.append(RequestOutput.from_request(req))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward pass over the scheduled requests; return the requests that finished."""
        finished, self._unclaimed = self._unclaimed, []
        if self.state is not EngineState.RUNNING:
            return finished  # NOTE: suspended: only outputs already finished (e.g. aborted) come out
        ctx = self.context
        plan = self.scheduler.schedule()
        if plan.empty:
            return finished
        batch = build_step_batch(ctx, plan, self.kv_cache.device)
        try:
            logits = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta, batch.logits_indices)
        except Exception:
            self.allocator.events.discard_pending()
            raise
        self.num_steps += 1
        ctx.kv_len[plan.slots] += plan.query_lens
        ctx.prefill_tokens += batch.prompt_tokens
        sample_slots, sample_rows = self._fork_groups(batch.sample_slots)
        # NOTE: forked samples have nothing to register: their full blocks are the parent's
        ctx.register_full_blocks(plan.slots)
        self.allocator.events.publish_pending()
        if batch.prompt_rows:  # NOTE: before the commit, which may release a request finished now
            self._record_prompt_logprobs(batch, logits)
        if sample_slots.size:  # NOTE: a step of mid-prompt chunks only samples nothing
            # NOTE: sampled rows come first in the logits; without forks a view, not a copy
            rows = logits[: sample_slots.size] if sample_rows is None else logits[sample_rows]
            out = self.sampler(rows, self._sampling_batch(sample_slots))
            finished += self._commit_tokens(sample_slots, out)
        return finished

    def _fork_groups(self, sample_slots: np.ndarray) -> tuple[np.ndarray, torch.Tensor | None]:
        """Samples 1..n-1 of a group whose prompt was just prefilled join as forks of sample 0.

        Returns the slots that sample and the logits rows they read (None: rows 0..n-1 in order,
        so the caller can take a view instead of copying the logits).
        """
        ctx = self.context
        forked_slots, forked_rows = [], []
        for row, slot in enumerate(sample_slots.tolist()):
            req = ctx.requests[slot]
            if not req.fork_children:
                continue
            children, req.fork_children = req.fork_children, []
            self.scheduler.reserved_slots -= len(children)
            full = int(ctx.prompt_len[slot]) // ctx.block_size
            for child in children:
                child_slot = ctx.fork(slot, child)
                if child_slot is None:  # no block for its partial copy: it prefills on its own
                    self.scheduler.add(child, front=True)
                    continue
                if ctx.num_blocks[slot] > full:  # the partial last prompt block is copied, not shared
                    src, dst = int(ctx.block_table[slot, full]), int(ctx.block_table[child_slot, full])
                    self.kv_cache.copy_blocks([src], [dst])
                forked_slots.append(child_slot)
                forked_rows.append(row)
        if not forked_slots:
            return sample_slots, None
        return (
            np.concatenate((sample_slots, np.array(forked_slots, dtype=np.int64))),
            torch.cat((torch.arange(sample_slots.size), torch.tensor(forked_rows, dtype=torch.int64))),
        )

    def _sampling_batch(self, slots: np.ndarray) -> SamplingBatch:
        ctx = self.context
        index = torch.from_numpy(slots)
        return SamplingBatch(
            temperature=ctx.temperature[index],
            top_k=ctx.top_k[index],
            top_p=ctx.top_p[index],
            min_p=ctx.min_p[index],
            generators=[ctx.generators[s] for s in slots.tolist()],
            num_top_logprobs=int(ctx.num_top_logprobs[slots].max()),
            logprobs_mode=ctx.processed_logprobs[index],
        )

    def _commit_tokens(self, slots: np.ndarray, out: Any) -> list[RequestOutput]:
        """Hand the sampled tokens to the context; turn the requests it finished into outputs."""
        ctx = self.context
        tokens = out.token_ids.numpy()
        self.generated_tokens += slots.size
        if out.top_logprobs is not None:
            self._record_top_logprobs(slots, out)
        finished = ctx.update_requests(slots, tokens, out.logprobs.numpy(), self.eos_token_ids)
        outputs = []
        for req, reason in finished:
            self._finish(req, reason)
            outputs.append(RequestOutput.from_request(req))
        return outputs

    def _record_top_logprobs(self, slots: np.ndarray, out: Any) -> None:
        ctx = self.context
        wanted = ctx.num_top_logprobs[slots]
        for row in np.flatnonzero(wanted).tolist():
            req = ctx.requests[int(slots[row])]
            n = int(wanted[row])
            ids = out.top_token_ids[row, :n].tolist()
            lps = out.top_logprobs[row, :n].tolist()
            if req.top_logprobs is None:
                req.top_logprobs = []
            req.top_logprobs.append(dict(zip(ids, lps)))

    def _record_prompt_logprobs(self, batch: Any, logits: torch.Tensor) -> None:
        ctx = self.context
        for rows in batch.prompt_rows:
            req = ctx.requests[rows.slot]
            n = req.params.prompt_logprobs
            targets = torch.from_numpy(ctx.tokens[rows.slot, rows.first_token : rows.first_token + rows.count])
            scored = compute_prompt_logprobs(logits[rows.start : rows.start + rows.count], targets, n)
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]  # the first prompt token has no prediction
            for i, lp in enumerate(scored.logprobs.tolist()):
                entry = {int(targets[i]): lp}
                if n:
                    entry.update(zip(scored.top_token_ids[i].tolist(), scored.top_logprobs[i].tolist()))
                req.prompt_logprobs.append(entry)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self._live.pop(req.request_id, None)

    # ---- blocking generation -----------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = False,
        on_step: Optional[Callable[[], None]] = None,
        abort_on_error: bool = False,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; outputs in prompt order, the n samples of a prompt together.

        `on_step` is called after every engine step (e.g. to sample KV use). Outputs of other
        callers' requests that finish meanwhile are kept for the next `step()`. If a step raises,
        this call's requests stay in the engine, or are aborted and dropped with `abort_on_error`.
        """
        if self.state is not EngineState.RUNNING:
            raise TensorStateDeallocatedError(None, f"generate() while the engine is {self.state.value}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: {len(params_list)} given for {len(prompts)} prompts")
        order: list[int] = []
        for prompt, params in zip(prompts, params_list):
            ids = self.add_request(prompt, params)
            order.extend(ids if isinstance(ids, list) else [ids])
        pending = set(order)
        results: dict[int, RequestOutput] = {}
        others: list[RequestOutput] = []  # finished requests of other callers: handed to the next step()
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="generate", unit="req")
        try:
            while pending:
                for output in self.step():
                    if output.request_id in pending:
                        pending.discard(output.request_id)
                        results[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
                    else:
                        others.append(output)
                if on_step is not None:
                    on_step()
        except BaseException:
            if abort_on_error:
                for request_id in pending:
                    self.abort(request_id)
                self._unclaimed = [o for o in self._unclaimed if o.request_id not in pending]
            raise
        finally:
            self._unclaimed.extend(others)
            if bar is not None:
                bar.close()
        return [results[i] for i in order]

    # ---- introspection -----------------------------------------------------------------------

    def kv_utilization(self) -> float:
        """Fraction of KV blocks held by requests now (cheap: two counters)."""
        return self.allocator.active / self.allocator.total

    def stats(self) -> dict:
        pool = self.allocator.stats()
        return {
            "steps": self.num_steps,
            "generated_tokens": self.generated_tokens,
            "prefill_tokens": self.context.prefill_tokens,
            "prefix_hit_blocks": pool.hit_blocks,
            "prefix_hit_rate": pool.hit_rate,
            "cross_version_prefix_hits": self.context.cross_version_hits,
            "policy_version": self.policy_version,
            "waiting": len(self.scheduler.waiting),
            **self.context.get_kvcache_utilization_stats(),
        }
