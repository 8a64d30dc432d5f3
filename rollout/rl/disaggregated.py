"""Disaggregated GRPO: the trainer in this process, engine replicas in processes of their own.

The colocated demo's task and model (`rollout.rl.colocated`), but the engines are `rollout serve`
replicas and the weights travel every step (`weight_sync.WeightSender`, gloo broadcast by
default). Each step:

    batch = router.generate(prompts, n)     # the router places each prompt's n samples on a replica
    grpo_step(policy, optimizer, batch)     # the trainer's own module, in this process
    sender.sync(policy, version=step + 1)   # buckets -> every replica -> one commit each

`off_policy=1` overlaps: the generation of step k+1 is sent before the trainer steps on batch k,
so it runs on the replicas (still on version k) while the trainer computes; the trainer waits
for it, then syncs. Every sample of step k >= 1 is then exactly one version behind the trainer
that consumes it, which the per-token versions prove each step (`stale_tokens` counts any token
of another version than planned, `max_staleness` the largest lag seen; the GRPO ratio uses the
engine's log-probs, so the lag is what PPO clipping bounds).

The replicas stand behind a router (`rollout route`): started here (`Fleet.spawn`: a router that
spawns and keeps its replicas, each sized for its share of a step) or already running
(`DisaggregatedConfig.router`, e.g. replicas on other hosts). The trainer talks to the router
only: generation, and weight sync (the router broadcasts each call to every replica, which claim
their ranks in the trainer's weight-update group). The run begins by syncing the trainer's
initial weights into all of them.

With `GRPOConfig.lora_rank` R the trainer trains a PEFT LoRA of rank R on every linear projection
(`rollout.rl.lora_policy`; its base frozen): the run's first sync puts the base weights in every
replica, then each step's sync moves the adapter's tensors alone (`WeightSender.sync_lora`, gloo
or shm), the adapter's next version on every replica, and every request names it. The per-token
versions are then the base's, which never moves (so every token must carry the first one), and
each sample's `lora_version` must be the adapter version just sent (the log-prob mismatch shows
it too: an adapter one version behind is off by far more than float rounding).

With `replica_dtype="bfloat16"` the replicas serve the fp32 trainer's bf16 cast; with `delta` every
sync after the first sends only what changed (`WeightSender(delta=True)`), bitwise the same weights
(the same seeds then sample the same tokens, step for step).

Checks that can fail: the per-token versions above; no prefix-cache hit crosses a version (the
replicas' own counters); at the end, every replica's greedy outputs on the held-out prompts (each
asked directly, not through the router) equal those of a fresh in-process engine built from the
trainer's final weights.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from inference import LogprobsMode, SamplingParams
from rollout.client.sync import RolloutClient
from rollout.rl import lora_policy
from rollout.rl.colocated import (
    EVAL_SEED,
    GRPOConfig,
    RunSummary,
    build_policy,
    format_summary,
    make_optimizer,
    summarize,
)
from rollout.rl.curriculum import Curriculum
from rollout.rl.grpo import grpo_step, shortfall_entropy
from rollout.rl.tasks import Problem, Task
from rollout.rl.tracking import StepTimer, Tracker
from rollout.rl.zero_mismatch import module_kernels_forward
from rollout.router.process import RouterProcess
from rollout.server.process import ServerProcess
from rollout.types import RolloutBatch
from weight_sync import Transport, WeightSender

STARTUP_TIMEOUT_S = 180.0
REPLICA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class DisaggregatedConfig:
    """How the engines run; `GRPOConfig` says what is trained."""

    replicas: int = 2  # spawned behind a router of our own (ignored with `router`)
    router: Optional[str] = None  # a running router's address (`rollout route`) instead; its replicas serve the model
    off_policy: int = 0  # 0: generate, train, sync in turn; 1: generation of k+1 overlaps training on k
    transport: Transport = Transport.GLOO  # a string from the CLI or a config converts here
    sync_timeout_s: float = 60.0  # bound of every wait of a weight sync, both sides
    replica_threads: int = 1  # torch threads per replica (the demo's ops are too small to split)
    replica_dtype: str = "float32"  # "bfloat16": the replicas serve the bf16 cast of the fp32 trainer
    delta: bool = False  # each sync sends what changed since the last one (weight_sync delta mode; gloo / shm)
    # "vllm": the replicas reached by vLLM-family calls only (rollout.rl.vllm_family: HTTP, vLLM's
    # weight phases over gloo, no router), as a trainer written for vLLM drives them
    api: str = "rollout"

    def __post_init__(self) -> None:
        self.transport = Transport(self.transport)
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"DisaggregatedConfig.replicas must be an int >= 1, got {self.replicas!r}")
        if self.off_policy not in (0, 1):
            raise ValueError(f"DisaggregatedConfig.off_policy must be 0 or 1, got {self.off_policy!r}")
        if not self.sync_timeout_s > 0:
            raise ValueError(f"DisaggregatedConfig.sync_timeout_s must be > 0, got {self.sync_timeout_s!r}")
        if self.replica_threads < 1:
            raise ValueError(f"DisaggregatedConfig.replica_threads must be >= 1, got {self.replica_threads!r}")
        if self.replica_dtype not in REPLICA_DTYPES:
            raise ValueError(f"DisaggregatedConfig.replica_dtype must be one of {sorted(REPLICA_DTYPES)}, got "
                             f"{self.replica_dtype!r}")
        if self.delta and self.transport not in (Transport.GLOO, Transport.SHM):
            raise ValueError(f"DisaggregatedConfig.delta rides gloo or shm, not {self.transport.value}")
        if self.api not in ("rollout", "vllm"):
            raise ValueError(f"DisaggregatedConfig.api must be rollout or vllm, got {self.api!r}")
        if self.api == "vllm" and (self.router is not None or self.delta or self.transport is not Transport.GLOO):
            raise ValueError("DisaggregatedConfig.api vllm: spawned replicas, gloo, no delta (vLLM's calls only)")


@dataclass(slots=True)
class DisaggregatedSummary:
    run: RunSummary
    replicas: int
    off_policy: int
    transport: str
    delta: bool
    replica_dtype: str
    delta_syncs: int  # syncs that sent a delta (the first one, and any after a failure, are full)
    lora_rank: Optional[int]  # the trained adapter's rank (None: full fine-tuning)
    sync_bytes: int  # bytes the last sync moved (with LoRA: the adapter's)
    step_seconds: float  # median wall time of a training step (generation wait, train, sync)
    sync_seconds: float  # median wall time of a weight sync, until every replica committed
    startup_seconds: float  # the replicas' start and the first sync (not in the steps)
    max_staleness: int  # the largest (trainer version - token version) of any trained token
    replicas_match_trainer: bool  # final greedy outputs of every replica == a fresh engine of the trainer's weights


class Fleet:
    """The replicas behind a router: `client` talks to the router (generation, weight sync, stats),
    `replicas` is how many stand behind it; `procs` are the processes this object started."""

    def __init__(self, client: RolloutClient, replicas: int, procs: Sequence[ServerProcess] = ()) -> None:
        self.client, self.replicas, self.procs = client, replicas, list(procs)

    @classmethod
    def spawn(cls, model_dir: Path, count: int, serve_args: Sequence[str]) -> Fleet:
        """`rollout route --spawn count` (a router process that starts and keeps its replicas)."""
        router = RouterProcess("--spawn", str(count), "--model", str(model_dir), "--ready-timeout-s",
                               str(STARTUP_TIMEOUT_S), "--", *serve_args, ready_timeout=STARTUP_TIMEOUT_S + 30)
        fleet = cls(RolloutClient(router.address, timeout=STARTUP_TIMEOUT_S), count, [router])
        try:
            fleet.check_up()
        except BaseException:
            fleet.close()
            raise
        return fleet

    @classmethod
    def connect(cls, router_address: str) -> Fleet:
        """A router already running (`rollout route`), left running by `close`."""
        client = RolloutClient(router_address, timeout=STARTUP_TIMEOUT_S)
        fleet = cls(client, int(client.stats()["replicas"]))
        fleet.check_up()
        return fleet

    def check_up(self) -> None:
        """Every replica up: a weight-update group needs each of them (a missing rank never joins)."""
        stats = self.client.stats()
        if stats["replicas_up"] != self.replicas:
            raise RuntimeError(f"{stats['replicas_up']} of the router's {self.replicas} replicas are up")

    def replica_addresses(self) -> list[str]:
        stats = self.client.stats()
        return [str(v) for k, v in sorted(stats.items()) if k.startswith("replica/") and k.endswith("/address")]

    def stat(self, key: str) -> int:
        return int(self.client.stats().get(key, 0))

    def close(self) -> None:
        self.client.close()
        for p in self.procs:
            p.stop()


def serve_args(cfg: GRPOConfig, dcfg: DisaggregatedConfig, task: Task) -> list[str]:
    """A replica's engine, sized for its share of a step at full length (as the colocated one)."""
    prompts = -(-cfg.prompts_per_step // dcfg.replicas)
    samples = prompts * cfg.samples_per_prompt
    longest = task.max_prompt_tokens + task.max_tokens
    blocks = samples * -(-longest // cfg.block_size)
    lora = [] if cfg.lora_rank is None else ["--max-loras", "1", "--max-lora-rank", str(cfg.lora_rank)]
    invariant = ["--batch-invariant"] if cfg.batch_invariant or cfg.zero_mismatch else []
    return [*invariant, "--dtype", dcfg.replica_dtype, "--threads", str(dcfg.replica_threads),
            "--block-size", str(cfg.block_size), "--num-blocks", str(blocks), "--max-requests", str(samples),
            "--max-batch-tokens", str(max(2048, samples)), "--max-seq-len", str(longest),
            "--weight-sync-timeout-s", str(dcfg.sync_timeout_s), *lora]


def run_disaggregated_grpo(cfg: GRPOConfig, dcfg: Optional[DisaggregatedConfig] = None) -> DisaggregatedSummary:
    """Train `cfg.model` with GRPO against `dcfg.replicas` engine processes (see module docstring)."""
    dcfg = dcfg or DisaggregatedConfig()
    if cfg.lora_rank is not None and (dcfg.api != "rollout" or dcfg.delta or dcfg.transport is Transport.DISK):
        raise ValueError("a LoRA run syncs its adapter alone over gloo / nccl / shm, through our own calls (no "
                         "delta, no vLLM-family api)")
    if cfg.zero_mismatch and (dcfg.off_policy or dcfg.replica_dtype != "float32" or dcfg.api != "rollout"
                              or cfg.lora_rank is not None):
        raise ValueError("zero_mismatch compares the trainer's forward with the replicas' sampling on the same weights "
                         "and bits: on policy (off_policy=0), replica_dtype float32 (the trainer's), our own calls "
                         "(api rollout), the full weights (a LoRA run only colocated, for now); got "
                         f"off_policy={dcfg.off_policy}, replica_dtype={dcfg.replica_dtype}, api={dcfg.api}, "
                         f"lora_rank={cfg.lora_rank}")
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    policy, task, pad_id = build_policy(cfg)
    name = cfg.run_name or (f"grpo-disagg-{cfg.model.value}-r{dcfg.replicas}-off{dcfg.off_policy}-seed{cfg.seed}-"
                            f"{time.strftime('%Y%m%d-%H%M%S')}")
    config = {**cfg.to_dict(), **{f"disaggregated/{k}": v for k, v in asdict(dcfg).items()}}
    config["disaggregated/transport"] = dcfg.transport.value
    tracker = Tracker(Path(cfg.out_dir) / name, cfg.steps, config=config, run_name=name, use_wandb=cfg.wandb,
                      table_every=cfg.table_every, max_reward=task.max_reward, show_progress=cfg.progress)
    work = Path(tempfile.mkdtemp(prefix="rollout-disagg-"))
    fleet: Optional[Fleet] = None
    loop: Optional[_Loop] = None
    try:
        if dcfg.router is not None:
            fleet = Fleet.connect(dcfg.router)
        elif dcfg.api == "vllm":
            from rollout.rl.vllm_family import VllmFleet

            save_model(policy, work / "initial")
            fleet = VllmFleet.spawn(work / "initial", dcfg.replicas, serve_args(cfg, dcfg, task), STARTUP_TIMEOUT_S)
        else:
            save_model(policy, work / "initial")  # NOTE: the replicas' architecture
            fleet = Fleet.spawn(work / "initial", dcfg.replicas, serve_args(cfg, dcfg, task))
        loop = _Loop(cfg, dcfg, policy, task, pad_id, tracker, fleet, work)
        first = loop.start()
        startup = time.perf_counter() - start
        loop.run(first)
        matches = loop.replicas_match_trainer()
    except BaseException:
        tracker.finish()
        raise
    finally:
        if loop is not None:
            loop.close()
        if fleet is not None:
            fleet.close()
        shutil.rmtree(work, ignore_errors=True)
        torch.set_num_threads(threads)
    run = summarize(tracker.history, task.max_reward, loop.stale_tokens, time.perf_counter() - start,
                    cross_version_hits=loop.cross_version_hits)
    paths = tracker.finish({k: v for k, v in asdict(run).items() if isinstance(v, (int, float))})
    run.out_dir, run.plot, run.wandb_dir, run.wandb_url = paths.out_dir, paths.plot, paths.wandb_dir, paths.wandb_url
    run.history = tracker.history
    return DisaggregatedSummary(
        run=run, replicas=fleet.replicas, off_policy=dcfg.off_policy, transport=dcfg.transport.value,
        delta=dcfg.delta, replica_dtype=dcfg.replica_dtype, delta_syncs=loop.delta_syncs, lora_rank=cfg.lora_rank,
        sync_bytes=loop.sync_bytes,
        step_seconds=statistics.median(h["time/step"] for h in tracker.history),
        sync_seconds=statistics.median(h["time/weight_update"] for h in tracker.history),
        startup_seconds=startup, max_staleness=loop.max_staleness, replicas_match_trainer=matches)


def save_model(policy: torch.nn.Module, directory: Path) -> None:
    """The trainer's model as an HF directory the replicas start from (their version 0)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    policy.config.save_pretrained(directory)
    tensors, seen = {}, set()
    for name, t in policy.state_dict().items():
        if t.data_ptr() in seen:
            continue  # NOTE: a tied LM head is the embedding: safetensors refuses a second view of it
        seen.add(t.data_ptr())
        tensors[name] = t.detach().contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


class _Loop:
    """The steps of one run (state the checks accumulate lives here)."""

    def __init__(self, cfg: GRPOConfig, dcfg: DisaggregatedConfig, policy: torch.nn.Module, task: Task, pad_id: int,
                 tracker: Tracker, fleet: Fleet, work: Path) -> None:
        self.cfg, self.dcfg, self.policy, self.task, self.pad_id = cfg, dcfg, policy, task, pad_id
        self.tracker, self.fleet = tracker, fleet
        directory = {"directory": work / "sync", "keep_last": 1} if dcfg.transport is Transport.DISK else {}
        # NOTE: one target, the router, standing for `fleet.replicas` engines (each claims its rank)
        cast = REPLICA_DTYPES[dcfg.replica_dtype]
        if dcfg.api == "vllm":
            from rollout.rl.vllm_family import VllmSender

            self.sender = VllmSender(fleet, dcfg.sync_timeout_s, dtype=None if cast is torch.float32 else cast)
        else:
            self.sender = WeightSender([fleet.client], dcfg.transport, replicas=fleet.replicas,
                                       timeout_s=dcfg.sync_timeout_s, delta=dcfg.delta,
                                       dtype=None if cast is torch.float32 else cast, **directory)
        mode = LogprobsMode.RAW if cfg.temperature == 1.0 else LogprobsMode.PROCESSED
        lora = None if cfg.lora_rank is None else lora_policy.ADAPTER_NAME
        self.sampling = SamplingParams(temperature=cfg.temperature, max_tokens=task.max_tokens, logprobs_mode=mode,
                                       lora_name=lora)
        self.base: Optional[torch.nn.Module] = None  # a LoRA run's frozen base (the policy is the PEFT model)
        self.lora_first = 0  # a LoRA run: the adapter's version at the start; step k syncs lora_first + k + 1
        self.ahead = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="generate-ahead")
        self.stale_tokens = 0  # tokens of another version than planned: must be 0
        self.cross_version_hits = 0
        self.max_staleness = 0

    def _generate(self, problems: list[Problem], step: int) -> RolloutBatch:
        seeded = dataclasses.replace(self.sampling, seed=self.cfg.seed * 1_000_003 + step)
        return self.fleet.client.generate([list(p.prompt_ids) for p in problems], self.cfg.samples_per_prompt,
                                          seeded)

    def start(self) -> int:
        """Sync the initial weights into every replica (whatever it held) under the next version
        of them all: the trainer's version 0, which step k's sync advances to `first + k + 1`."""
        first = int(self.fleet.client.get_weight_version()) + 1
        self.sender.sync(self.policy, version=first)
        if self.cfg.lora_rank is not None:  # NOTE: the base went in whole once; from now on the adapter alone
            cfg = self.cfg
            self.policy, self.base = lora_policy.trained_lora(self.policy, rank=cfg.lora_rank, targets=cfg.lora_targets,
                                                              alpha=cfg.lora_alpha or 2.0 * cfg.lora_rank)
            loaded = [i.version for i in self.fleet.client.list_loras() if i.name == lora_policy.ADAPTER_NAME]
            self.lora_first = max(loaded, default=0) + 1
            self.sender.sync_lora(lora_policy.ADAPTER_NAME, self.policy, version=self.lora_first)
        return first

    def _sync(self, first: int, step: int) -> None:
        """Step `step`'s weights into every replica: the policy's next version, or the adapter's."""
        if self.cfg.lora_rank is None:
            self.sender.sync(self.policy, version=first + step + 1)
        else:
            self.sender.sync_lora(lora_policy.ADAPTER_NAME, self.policy, version=self.lora_first + step + 1)

    def run(self, first: int) -> None:
        cfg, task = self.cfg, self.task
        rng = random.Random(cfg.seed)
        held_out = task.held_out()
        optimizer, schedule = make_optimizer(cfg, self.policy)
        # NOTE: the replicas sample in the batch-invariant mode; this forward runs their kernels here, on the
        # trainer's own weights, which every sync copies to them bit for bit
        trainer_forward = (module_kernels_forward(self.policy, cfg.block_size, cfg.temperature) if cfg.zero_mismatch
                           else None)
        curriculum = Curriculum(task, pool=cfg.curriculum_pool, floor=cfg.curriculum_floor)
        problems = curriculum.sample(rng, cfg.prompts_per_step)
        pending = self.ahead.submit(self._generate, problems, 0)
        try:
            for step in range(cfg.steps):
                timer = StepTimer()
                step_start = time.perf_counter()
                with timer("wait"):
                    batch = pending.result()
                evaluation, eval_batches = {}, []
                if held_out and (step % cfg.eval_every == 0 or step == cfg.steps - 1):
                    with timer("eval"):
                        evaluation, eval_batches = self._evaluate(held_out)
                rewards = [task.reward(problems[r.group], r.completion_ids) for r in batch]
                curriculum.update(problems, batch.groups, rewards)
                next_problems = curriculum.sample(rng, cfg.prompts_per_step) if step + 1 < cfg.steps else None
                if self.dcfg.off_policy and next_problems is not None:  # k+1 runs on version k meanwhile
                    pending = self.ahead.submit(self._generate, next_problems, step + 1)
                lr = schedule.get_last_lr()[0]
                with timer("train"):
                    stats = grpo_step(self.policy, optimizer, batch, rewards, clip_eps=cfg.clip_eps,
                                      max_grad_norm=cfg.max_grad_norm, micro_batch_size=cfg.micro_batch_size,
                                      pad_id=self.pad_id, temperature=cfg.temperature,
                                      entropy_coef=shortfall_entropy(rewards, batch.groups, cfg.entropy_coef,
                                                                     task.max_reward),
                                      scale_advantages=cfg.scale_advantages, trainer_forward=trainer_forward)
                schedule.step()
                if self.dcfg.off_policy and next_problems is not None:
                    with timer("wait"):
                        pending.result()  # NOTE: the replicas finish version k's samples before k+1 lands
                cross_before = self.fleet.stat("engine/cross_version_prefix_hits")
                with timer("weight_update"):
                    self._sync(first, step)
                if not self.dcfg.off_policy and next_problems is not None:
                    pending = self.ahead.submit(self._generate, next_problems, step + 1)
                # the trainer's own plan of versions, so a replica that skipped one is caught: batch k
                # was sampled by version k (k - 1 when it overlapped step k - 1), the evaluation by k
                moves = self.cfg.lora_rank is None  # NOTE: with LoRA the tokens' version is the base's, fixed
                planned = first + max(0, step - self.dcfg.off_policy) if moves else first
                step_stale = sum(v != planned for r in batch for v in r.versions)
                step_stale += sum(v != (first + step if moves else first) for b in eval_batches for r in b
                                  for v in r.versions)
                staleness = max(((first + step if moves else first) - v for r in batch for v in r.versions),
                                default=0)
                if not moves:  # NOTE: a LoRA run: every sample's adapter version (PIN: one for all its tokens)
                    adapter = self.lora_first + max(0, step - self.dcfg.off_policy)
                    step_stale += sum(len(r.versions) for r in batch if r.lora_version != adapter)
                    step_stale += sum(len(r.versions) for b in eval_batches for r in b
                                      if r.lora_version != self.lora_first + step)
                step_cross = self.fleet.stat("engine/cross_version_prefix_hits") - cross_before
                self.stale_tokens += step_stale
                self.max_staleness = max(self.max_staleness, staleness)
                self.cross_version_hits += step_cross
                timer.seconds["step"] = time.perf_counter() - step_start
                self.tracker.log(step, {
                    "reward": sum(rewards) / len(rewards), **evaluation,
                    "response_length": sum(batch.completion_lengths) / len(batch),
                    "tokens_per_s": batch.stats.tokens_per_second, "time/generate": batch.stats.seconds,
                    **timer.metrics(), "mismatch/mean": stats.mismatch_mean, "mismatch/max": stats.mismatch_max,
                    "mismatch/tokens": stats.mismatched_tokens,
                    "policy_version": batch.policy_version, "staleness": staleness, "stale_tokens": step_stale,
                    "prefix_hits_cross_version": step_cross, "loss": stats.loss, "grad_norm": stats.grad_norm,
                    "clip_fraction": stats.clip_fraction, "completion_tokens": batch.stats.completion_tokens,
                    "entropy": stats.entropy, "signal_fraction": stats.signal_fraction,
                    "advantage_std": stats.advantage_std, "lr": lr, "weight_sync/bytes": self.sync_bytes,
                    **({} if moves else {"lora_version": self.lora_first + step + 1}),
                }, example=task.render(problems[batch[0].group], batch[0].completion_ids))
                problems = next_problems
        finally:
            self.ahead.shutdown(wait=False, cancel_futures=True)

    def _evaluate(self, problems: list[Problem]) -> tuple[dict[str, float], list[RolloutBatch]]:
        """Mean reward on prompts never trained on: greedy, and sampled as in training (fixed seed)."""
        prompts = [list(p.prompt_ids) for p in problems]
        greedy = self.fleet.client.generate(prompts, 1, dataclasses.replace(self.sampling, temperature=0.0, seed=None))
        sampled = self.fleet.client.generate(prompts, self.cfg.samples_per_prompt,
                                         dataclasses.replace(self.sampling, seed=EVAL_SEED))

        def mean_reward(batch: RolloutBatch) -> float:
            return sum(self.task.reward(problems[r.group], r.completion_ids) for r in batch) / len(batch)

        return {"heldout/greedy": mean_reward(greedy), "heldout/sampled": mean_reward(sampled)}, [greedy, sampled]

    @property
    def delta_syncs(self) -> int:
        return self.sender.stats.delta_syncs

    @property
    def sync_bytes(self) -> int:
        """Bytes the last sync moved (0 where the sender does not count them: the vLLM-family calls)."""
        return getattr(self.sender.stats, "last_bytes", 0)

    def close(self) -> None:
        self.ahead.shutdown(wait=False, cancel_futures=True)
        self.sender.close()

    def replicas_match_trainer(self) -> bool:
        """Every replica's greedy outputs on the held-out prompts == a fresh engine of the trainer's weights."""
        from rollout.local import RolloutEngine
        from rollout.rl.colocated import engine_config

        prompts = [list(p.prompt_ids) for p in self.task.held_out()] or [[1, 2]]
        greedy = dataclasses.replace(self.sampling, temperature=0.0, seed=None)
        config = dataclasses.replace(engine_config(self.cfg, self.task), dtype=REPLICA_DTYPES[self.dcfg.replica_dtype])
        if self.base is not None:  # NOTE: a LoRA run: the frozen base serving the adapter as trained
            fresh = lora_policy.fresh_engine(self.base, self.policy, config)
        else:
            fresh = RolloutEngine(self.policy, config)  # NOTE: the replicas' dtype: a bf16 fleet serves the bf16 cast
        try:
            expected = [r.completion_ids for r in fresh.generate(prompts, 1, greedy)]
        finally:
            fresh.close()
        addresses = self.fleet.replica_addresses()
        if len(addresses) != self.fleet.replicas:
            return False
        outputs = []
        for address in addresses:  # NOTE: each replica directly, so none hides behind the router's placement
            if self.dcfg.api == "vllm":
                outputs.append([r.completion_ids for r in self.fleet.client.generate(prompts, 1, greedy, url=address)])
                continue
            with RolloutClient(address, timeout=STARTUP_TIMEOUT_S) as replica:
                outputs.append([r.completion_ids for r in replica.generate(prompts, 1, greedy)])
        return all(o == expected for o in outputs)


def format_disaggregated(s: DisaggregatedSummary) -> str:
    mode = "off-policy 1 (generation of step k+1 overlaps training on k)" if s.off_policy else "on-policy"
    return "\n".join([
        f"disaggregated: {s.replicas} {s.replica_dtype} replicas, weights over {s.transport} every step"
        f"{f' as deltas ({s.delta_syncs} delta syncs)' if s.delta else ''}"
        f"{f' (a rank-{s.lora_rank} LoRA adapter alone: {s.sync_bytes} bytes a sync)' if s.lora_rank else ''}, {mode}",
        format_summary(s.run),
        f"per step: {s.step_seconds:.3f} s median (weight sync {s.sync_seconds * 1e3:.1f} ms median); replicas "
        f"started in {s.startup_seconds:.1f} s; max staleness {s.max_staleness} version(s)",
        f"replicas' final greedy outputs == a fresh engine of the trainer's weights: {s.replicas_match_trainer}",
    ])


__all__ = ["DisaggregatedConfig", "DisaggregatedSummary", "Fleet", "format_disaggregated", "run_disaggregated_grpo",
           "save_model", "serve_args"]
