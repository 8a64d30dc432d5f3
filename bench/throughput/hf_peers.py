"""The HF transformers peers of the rollout-throughput benchmark, each run at a configuration swept
by the driver: `generate` (static batches) and continuous batching.

What each peer is told about a sample's length (its target, see `rollout_workload.py`):
* `generate`: a logits processor, `ForceEosAtLength`, that bans EOS before the sample's target and
  forces it as the target-th token; `max_new_tokens` is the workload's shared upper bound. A row
  that sampled EOS is finished: HF keeps computing it, padded, until its whole call is done.
* continuous batching: each request's own `max_new_tokens` = its target (EOS never stops it), the
  same information the engine gets.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from bench.common import load_average
from bench.throughput.rollout_workload import FIRST_TOKEN, Budget, RunResult, Workload


class Prefill(str, enum.Enum):
    """How `generate` prefills a prompt that has n samples.

    REPEAT: `num_return_sequences=n`, every prompt row prefilled n times (what `generate` does).
    ONCE: the batch of prompts prefilled once, its DynamicCache expanded n-fold along the batch,
    and `generate` continued from that cache (the last prompt token runs once per sample row).
    """

    REPEAT = "repeat"
    ONCE = "once"


class ForceEosAtLength(LogitsProcessor):
    """Row r bans EOS before its `targets[r]`-th generated token and forces EOS as that token.

    Invariant: `targets` follows the rows of the call (prompt-major, n rows per prompt), and
    `prompt_width` is the padded prompt width, so `input_ids.shape[1] - prompt_width` is the number
    of tokens each row has generated so far.
    """

    def __init__(self, targets: list[int], prompt_width: int, eos: int) -> None:
        self.last = torch.tensor(targets, dtype=torch.long) - 1  # index of the EOS token of each row
        self.prompt_width = prompt_width
        self.eos = eos

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_width
        scores[:, self.eos] = scores[:, self.eos].masked_fill(self.last > step, float("-inf"))
        at = (self.last == step).nonzero().flatten()
        if at.numel():
            scores[at] = float("-inf")
            scores[at, self.eos] = 0.0
        return scores


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    """`static`: a static KV cache (`cache_implementation="static"`) and the decode step compiled by
    HF's own auto-compile (`CompileConfig`, inductor, told to compile on CPU too), every call's
    prompts padded to the workload's longest so its shapes, and the compiled graph, repeat.
    Static caches are not expanded from a prefilled DynamicCache: `static` goes with REPEAT."""

    prompts_per_call: int
    prefill: Prefill
    static: bool = False

    def __post_init__(self) -> None:
        if self.static and self.prefill is not Prefill.REPEAT:
            raise ValueError("GenerateConfig: a static cache goes with Prefill.REPEAT (not expanded from a prefill)")

    @property
    def key(self) -> str:
        return f"hf-generate {self.prefill.value} x{self.prompts_per_call}{' static+compile' if self.static else ''}"


def _compile_config():
    from transformers import CompileConfig

    # NOTE: "default": the "reduce-overhead" default captures CUDA graphs, which a CPU has not
    config = CompileConfig(mode="default", fullgraph=False, dynamic=False)
    config._compile_all_devices = True  # HF's own switch for compiling off the GPU
    return config


def _special_ids(model) -> tuple[int, int]:
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None:
        raise ValueError("the model has no eos_token_id: ForceEosAtLength needs one")
    return (0 if pad is None else int(pad)), int(eos)


def _left_padded(prompts: list[list[int]], pad: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    width = width or max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def _prefill_once(model, ids: torch.Tensor, mask: torch.Tensor, n: int):
    """The DynamicCache of every prompt but its last token, computed once and expanded n-fold."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what `generate` derives from a left-padded mask
    out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                use_cache=True, logits_to_keep=1)  # fmt: skip
    cache = out.cache
    cache.batch_repeat_interleave(n)
    return cache


@torch.no_grad()
def _generate_call(model, work: Workload, groups: list[int], config: GenerateConfig,
                   targets: list[int] | None = None) -> tuple[int, int, bool]:
    """One `generate` call over prompts `groups`, n rows each; (prefill tokens, sampled tokens, ok).
    `targets`: other lengths than the workload's (a warm-up's), one per row."""
    pad, eos = _special_ids(model)
    n, prefill = work.n, config.prefill
    width = max(map(len, work.prompts)) if config.static else None
    ids, mask = _left_padded([work.prompts[g] for g in groups], pad, width)
    rows, width = ids.shape[0] * n, ids.shape[1]
    targets = targets or [length for g in groups for length in work.lengths[g]]
    kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=pad,
        max_new_tokens=work.max_output, logits_processor=LogitsProcessorList([ForceEosAtLength(targets, width, eos)]),
    )  # fmt: skip
    if config.static:
        kwargs.update(cache_implementation="static", compile_config=_compile_config())
    if prefill is Prefill.REPEAT:
        out = model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=n, **kwargs)
        prefilled = rows * width
    else:
        cache = _prefill_once(model, ids, mask, n)
        ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **kwargs)
        prefilled = ids.shape[0] // n * (width - 1) + rows
    new = out[:, width:]
    # ok: each row's first EOS is its target-th token, and only padding follows it
    first_eos = torch.where(new == eos, torch.arange(new.shape[1]), new.shape[1]).min(dim=1).values
    after = torch.arange(new.shape[1])[None, :] > first_eos[:, None]
    ok = out.shape[0] == rows and first_eos.tolist() == [t - 1 for t in targets] and bool((new[after] == pad).all())
    return prefilled, new.numel(), ok


def run_generate(model, work: Workload, config: GenerateConfig, give_up_s: float | None = None) -> RunResult:
    """Prompts sorted by their group's longest sample, in calls of `prompts_per_call` prompts.

    With `give_up_s`, calls stop once that many seconds have passed: the result is then marked
    `stopped`, its wall time is a lower bound and its tok/s (all useful tokens / it) an upper bound.
    """
    order = sorted(range(len(work.prompts)), key=lambda g: max(work.lengths[g]), reverse=True)
    step = config.prompts_per_call
    calls = [order[i : i + step] for i in range(0, len(order), step)]
    if config.static:  # NOTE: compiles for each call size (shapes are fixed); every row stops at its 2nd token
        for groups in {len(c): c for c in calls}.values():
            _generate_call(model, work, groups, config, targets=[2] * (len(groups) * work.n))
    else:
        _generate_call(model, work, [0], config)  # warm-up
    prefilled = sampled = done = 0
    ok, load = True, load_average()
    start = time.perf_counter()
    for groups in calls:
        p, s, call_ok = _generate_call(model, work, groups, config)
        prefilled, sampled, ok, done = prefilled + p, sampled + s, ok and call_ok, done + 1
        if give_up_s is not None and done < len(calls) and time.perf_counter() - start > give_up_s:
            break
    wall = time.perf_counter() - start
    note = f"{len(calls)} calls of {step} prompts x n={work.n} rows"
    result = RunResult(config.key, "hf-generate", work.useful_tokens, sampled, prefilled, wall, load, ok, note)
    if done < len(calls):
        result.stopped = True
        result.note += f"; STOPPED after {done} calls at {wall:.0f} s (tok/s is an upper bound, tokens partial)"
    return result


@torch.no_grad()
def run_continuous(model, work: Workload, budget: Budget, page_size: int) -> RunResult:
    """HF continuous batching through the manager `generate_batch` wraps, one request per sample with
    its own `max_new_tokens`; KV capacity, step tokens and request cap are the engine's."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    pad, _ = _special_ids(model)
    gen = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=pad,
        max_new_tokens=work.max_output, num_return_sequences=1,
    )  # fmt: skip
    cb = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=budget.kv_tokens // page_size,
        max_batch_tokens=budget.step_tokens,
        max_requests_per_batch=budget.max_requests,
    )
    hints = WorkloadHints(
        max_prompt_length=max(map(len, work.prompts)),
        max_generated_length=work.max_output,
        num_requests=len(work.prompts) * work.n,
    )
    setup = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, workload_hints=hints
    ) as manager:
        setup_s = time.perf_counter() - setup
        _drain(manager, {manager.add_request([FIRST_TOKEN + i] * 40, max_new_tokens=4): 4 for i in range(4)})
        load = load_average()
        start = time.perf_counter()
        asked = {}
        for prompt, lengths in zip(work.prompts, work.lengths):
            for length in lengths:
                asked[manager.add_request(prompt, max_new_tokens=length)] = length
        ok, error = _drain(manager, asked)
        wall = time.perf_counter() - start
    note = f"page {page_size}; set-up + warm-up {setup_s:.1f} s not timed; prefill not reported"
    if error:
        note += f"; {error}"
    key = f"hf-continuous page {page_size}"
    return RunResult(key, "hf-continuous", work.useful_tokens, work.useful_tokens, -1, wall, load, ok, note)


def _drain(manager, asked: dict[str, int], timeout_s: float = 600.0) -> tuple[bool, str]:
    """Wait for every request in `asked`; (all got exactly their tokens, first error if any)."""
    pending, ok, error = set(asked), True, ""
    while pending:
        result = manager.get_result(timeout=timeout_s)
        if result is None:
            return False, f"no result within {timeout_s:.0f} s ({len(pending)} pending)"
        if not result.is_finished() or result.request_id not in pending:
            continue
        pending.discard(result.request_id)
        if result.error is not None:
            ok, error = False, error or f"request failed: {result.error}"
        ok &= len(result.generated_tokens) == asked[result.request_id]
    return ok, error
