"""`rollout grpo --lora R`, colocated: the trainer steps a PEFT adapter, the engine aliases it.

Each step must sample under the adapter version the trainer expects (1 + its steps) while the
base version never moves, never hit a prefix block of the previous version, and agree with the
trainer's recomputation through PEFT; the engine reads the PEFT parameters themselves (by
address), a step changes what it samples without any copy, and the base weights stay untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from inference import SamplingParams
from rollout.cli import build_parser, config_from_args
from rollout.local import RolloutEngine
from rollout.rl.colocated import LORA_PRESETS, GRPOConfig, ModelKind, make_optimizer, run_grpo
from rollout.rl.grpo import grpo_step, token_logprobs
from rollout.rl.lora_policy import ADAPTER_NAME, ColocatedLoRA
from rollout.rl.tasks import DigitVocab
from tests.rollout.conftest import small_engine_config, tiny_policy

D = DigitVocab.digit
PROMPTS = [[DigitVocab.BOS, D(d), D(d + 1), D(d + 2), D(d + 3)] for d in range(6)]  # full blocks of 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reward(completion):  # any non-constant reward will do: long completions score
    return len(completion) / 8


def forward_reads(lora: ColocatedLoRA) -> set[int]:
    adapter = lora.engine.engine.core.loras.adapter(lora.ref.id)
    return {t.data_ptr() for layer in adapter.fused for blocks in layer.values()
            for a, _, parts in blocks for t in (a, *(bt for *_, bt in parts))}


def test_each_step_samples_the_trainers_adapter_in_place_and_the_base_stays():
    policy = tiny_policy(seed=1)
    base = {n: p.detach().clone() for n, p in policy.named_parameters()}
    engine = RolloutEngine(policy, small_engine_config(block_size=2))
    base_ptrs = engine.engine.core.model.weights_signature()
    lora = ColocatedLoRA.attach(engine, policy, rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    lora_params = {p.data_ptr() for n, p in lora.model.named_parameters() if "lora_" in n}
    assert forward_reads(lora) == lora_params and len(lora_params) == 2 * 3 * 2  # zero copy
    cfg = GRPOConfig(lr=2e-2, lr_final=None)  # big steps: a stale adapter would show
    optimizer, _ = make_optimizer(cfg, lora.model)
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for n, p in lora.model.named_parameters() if "lora_" in n)  # the adapter trains, only it
    sampling = SamplingParams(max_tokens=8, lora_name=ADAPTER_NAME)
    engine.suspend()
    previous = None
    for step in range(3):
        engine.resume()  # suspend / resume with the adapter loaded
        batch = engine.generate(PROMPTS, n=4, sampling=dataclasses.replace(sampling, seed=step))
        assert {r.lora_version for r in batch} == {step + 1} and batch.versions == {0}
        assert batch.stats.prefix_hit_blocks == 0 and batch.stats.prefix_lookup_blocks > 0  # none of the last version
        control = engine.generate(PROMPTS, n=1, sampling=SamplingParams(max_tokens=1, lora_name=ADAPTER_NAME))
        assert control.stats.prefix_hit_blocks > 0  # within one version the same prompts do hit
        engine.suspend()
        padded = batch.to_padded_tensors()
        if previous is not None:  # the last step's adapter disagrees with what was sampled: the check has teeth
            with torch.no_grad():
                stale = token_logprobs(previous, padded.input_ids, padded.loss_mask)
            assert (stale - padded.old_logprobs[padded.loss_mask]).abs().max() > 1e-3
        previous = copy.deepcopy(lora.model)
        stats = grpo_step(lora.model, optimizer, batch, [reward(r.completion_ids) for r in batch])
        assert stats.grad_norm > 0
        assert stats.mismatch_max <= 1e-5, f"step {step}: engine and trainer (PEFT) disagree by {stats.mismatch_max}"
        assert lora.updated() == step + 2
        assert forward_reads(lora) == lora_params
    assert engine.policy_version == 0 and engine.engine.core.model.weights_signature() == base_ptrs
    for name, p in lora.model.get_base_model().named_parameters():
        if "lora_" not in name:  # PEFT moved each adapted Linear under `base_layer`: the same tensor
            assert torch.equal(p, base[name.replace(".base_layer", "")]), name


def test_run_grpo_with_lora_passes_the_loops_checks(tmp_path, no_plot):
    cfg = GRPOConfig.preset(ModelKind.TINY, steps=3, prompts_per_step=4, samples_per_prompt=4, lora_rank=4,
                            out_dir=str(tmp_path), run_name="t", wandb=False, progress=False, eval_every=2)
    assert cfg.lr == LORA_PRESETS[ModelKind.TINY]["lr"] and cfg.lora_alpha is None
    summary = run_grpo(cfg)
    assert summary.steps == 3 and summary.stale_tokens == 0 and summary.cross_version_hits == 0
    assert summary.mismatch_max <= 1e-5
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lora_version"] for r in rows] == [1, 2, 3] and [r["policy_version"] for r in rows] == [0, 0, 0]
    assert all(r["stale_tokens"] == 0 and r["grad_norm"] > 0 for r in rows)


def test_the_lora_flag_and_its_validation():
    cfg = config_from_args(build_parser().parse_args(["grpo", "--model", "smollm2", "--lora", "16"]))
    assert cfg.lora_rank == 16 and cfg.lr == LORA_PRESETS[ModelKind.SMOLLM2]["lr"] and cfg.temperature == 0.7
    cfg = config_from_args(build_parser().parse_args(["grpo", "--lora", "8", "--lr", "3e-3", "--lora-alpha", "4"]))
    assert (cfg.lora_rank, cfg.lr, cfg.lora_alpha) == (8, 3e-3, 4)
    assert config_from_args(build_parser().parse_args(["grpo"])).lora_rank is None
    with pytest.raises(ValueError, match="GRPOConfig.lora_rank"):
        GRPOConfig(lora_rank=0)
    with pytest.raises(ValueError, match="GRPOConfig.lora_targets"):
        GRPOConfig(lora_rank=4, lora_targets=("embed_tokens",))
