"""The rollout-throughput workload and what one run of it reports, shared by every runner.

A workload is `prompts[g]` with `n` samples each, sample j of prompt g asked for exactly
`lengths[g][j]` tokens (its target). Every runner is told each target (see
`rollout_throughput.py` for how) and must return exactly that many tokens per sample.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_TOKEN = 3  # random prompt tokens avoid the special ids 0-2 (pad, bos, eos of the tiny Llama)
PAGE_LCM = 256  # KV capacities are whole pages of every page size swept (16 ... 256)


@dataclass(frozen=True, slots=True)
class Workload:
    """`prompts[g]` is prompt g; `lengths[g][j]` the output length asked of its sample j."""

    prompts: list[list[int]]
    lengths: list[list[int]]
    max_output: int  # the shared upper bound on any sample's length (the workload's `--output-len` high)

    @property
    def n(self) -> int:
        return len(self.lengths[0])

    @property
    def useful_tokens(self) -> int:
        return sum(map(sum, self.lengths))

    @property
    def max_total_len(self) -> int:
        return max(len(p) + max(ls) for p, ls in zip(self.prompts, self.lengths))

    def describe(self) -> str:
        plens = [len(p) for p in self.prompts]
        return (
            f"{len(self.prompts)} prompts x n={self.n}, prompt {min(plens)}-{max(plens)} tokens, "
            f"output {min(map(min, self.lengths))}-{max(map(max, self.lengths))} tokens per sample "
            f"(upper bound {self.max_output}), {self.useful_tokens:,} tokens asked for"
        )


def make_workload(
    num_prompts: int, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int,
    group_lengths: bool = False,
) -> Workload:
    """Random prompts and targets; with `group_lengths` the n samples of a prompt share one target
    (a static batcher's best case: padding within a group wastes nothing)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num_prompts)]
    if group_lengths:
        lengths = [[rng.randint(*output_len)] * n for _ in range(num_prompts)]
    else:
        lengths = [[rng.randint(*output_len) for _ in range(n)] for _ in range(num_prompts)]
    return Workload(prompts, lengths, output_len[1])


@dataclass(slots=True)
class RunResult:
    """One timed run of one runner configuration.

    useful = the tokens the samples were asked for; sampled = tokens drawn, counted or not (HF
    `generate` keeps sampling rows that already stopped, then pads them); prefill = prompt positions
    run through the model, left padding included.
    """

    key: str  # the configuration, e.g. "hf-generate once x16"
    family: str  # "engine", "hf-generate" or "hf-continuous"
    useful_tokens: int
    sampled_tokens: int
    prefill_tokens: int
    wall_s: float
    load: float  # 1-minute load average when the run started
    ok: bool = True  # every sample got exactly the tokens asked for
    note: str = ""
    stopped: bool = False  # given up part-way (see `--give-up`): wall is a lower bound

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s


@dataclass(frozen=True, slots=True)
class Budget:
    """The serving limits the engine and HF continuous batching get alike."""

    kv_tokens: int  # KV cache capacity in tokens
    step_tokens: int  # tokens per forward step
    max_requests: int

    @classmethod
    def for_workload(cls, model, work: Workload, kv_gib: float, step_tokens: int, max_requests: int) -> Budget:
        """KV capacity: `kv_gib` of the model's KV, capped at what `max_requests` of the workload's
        longest sequences can ever hold at once (more is never used, and HF continuous batching
        sizes its attention masks by it: 2 GiB of KV made it refuse with a MemoryError)."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
        by_memory = int(kv_gib * 2**30 // per_token)
        by_need = max_requests * work.max_total_len
        tokens = -(-min(by_memory, by_need) // PAGE_LCM) * PAGE_LCM
        return cls(tokens, step_tokens, max_requests)
