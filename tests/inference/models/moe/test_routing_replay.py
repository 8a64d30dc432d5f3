"""Routing replay: the engine records each token's experts; an HF MoE trainer replays them.

In fp32 the engine routes as HF computing in float64 does, which checks that the record is aligned
by position (chunked prefill, forks of n samples). In bf16 they do not: the test measures the fraction of tokens routed
to other experts, and the log-prob mismatch, with and without replay (with: zero flips)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.models.moe.routing_replay import pad_routes, replay_routing, routing_flips
from rollout.rl.grpo import grpo_step
from rollout.types import Rollout, RolloutBatch
from tests.inference.engine.conftest import random_prompts
from tests.inference.models.moe.tiny import tiny_moe
from tests.reference import float64_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(dtype=torch.float32, **overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=256, max_requests=16, max_batch_tokens=48, chunked_prefill_size=8,
                  max_sequence_length=64, dtype=dtype)
    fields.update(overrides)
    return InferenceConfig(**fields)


def generate(hf, dtype, prompts, **params):
    engine = DynamicInferenceEngine.from_pretrained(hf, config(dtype))
    return engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, return_routed_experts=True,
                                                   **params))


@torch.no_grad()
def trainer_pass(hf, outputs, replay: bool):
    """HF forward of each sample (padded batch): (flip fraction over tokens, |dlogprob| per token)."""
    seqs = [o.prompt_token_ids + o.generated_token_ids for o in outputs]
    length = max(map(len, seqs))
    ids = torch.zeros(len(seqs), length, dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    routes = pad_routes([o.routed_experts for o in outputs], length)
    with replay_routing(hf, routes if replay else None) as used:
        logits = hf(ids).logits.double()
    trainer = torch.stack([u[0] for u in used], dim=1).view(len(seqs), length, *routes.shape[2:])
    flips, diffs = [], []
    for b, (s, o) in enumerate(zip(seqs, outputs)):
        n = len(s) - 1  # every token the engine computed
        flips.append(routing_flips(routes[b, :n], trainer[b, :n]).any(-1))
        p = len(o.prompt_token_ids)
        ref = torch.log_softmax(logits[b, p - 1 : len(s) - 1], -1).gather(
            1, torch.tensor(o.generated_token_ids)[:, None])[:, 0]
        diffs.append((ref - torch.tensor(o.logprobs)).abs())
    return torch.cat(flips).float().mean().item(), torch.cat(diffs)


def test_fp32_routes_match_hf_by_position_with_chunks_and_forks():
    hf = tiny_moe("qwen3_moe", seed=11)
    prompts = random_prompts(5, 10, 30, seed=3)
    outputs = generate(hf, torch.float32, prompts, n=2, temperature=1.0, seed=5)
    for o in outputs:
        assert o.routed_experts.shape == (len(o.prompt_token_ids) + len(o.generated_token_ids) - 1, 2, 2)
        assert o.routed_experts.min() >= 0 and o.routed_experts.max() < 8
    first, second = outputs[0], outputs[1]  # two samples of one prompt share its routing
    p = len(first.prompt_token_ids)
    assert np.array_equal(first.routed_experts[:p], second.routed_experts[:p])
    flips, diffs = trainer_pass(float64_copy(hf), outputs, replay=False)
    # NOTE: |log p| < 7 (tiny logits), half an fp32 ulp 2.4e-7 there: measured max 5.3e-7; 5e-6 is 9x.
    # No flips: the closest 2nd and 3rd router logits are 4.7e-5 apart (float64), 20x their fp32 error (2.3e-6).
    assert flips == 0.0 and diffs.max() < 5e-6


def test_bf16_flips_without_replay_and_none_with_it(capsys):
    hf = tiny_moe("qwen3_moe", seed=12, dtype=torch.bfloat16, router_std=None)  # HF's near-uniform routers
    outputs = generate(hf, torch.bfloat16, random_prompts(12, 8, 30, seed=4), temperature=1.0, seed=6)
    flips_off, diffs_off = trainer_pass(hf, outputs, replay=False)
    flips_on, diffs_on = trainer_pass(hf, outputs, replay=True)
    with capsys.disabled():
        print(f"\nbf16 routing replay: tokens routed differently {flips_off:.1%} -> {flips_on:.1%}; "
              f"|dlogprob| mean {diffs_off.mean():.4f} -> {diffs_on.mean():.4f}, "
              f"max {diffs_off.max():.3f} -> {diffs_on.max():.3f}")
    assert flips_off > 0.0
    assert flips_on == 0.0
    assert diffs_on.mean() < diffs_off.mean()


def test_grpo_step_replays_through_the_same_hook():
    hf = tiny_moe("qwen3_moe", seed=13, dtype=torch.bfloat16, router_std=None)
    outputs = generate(hf, torch.bfloat16, random_prompts(4, 8, 20, seed=8), n=2, temperature=1.0, seed=9)
    batch = RolloutBatch([Rollout(o.prompt_token_ids, o.generated_token_ids, o.logprobs, o.token_versions,
                                  o.finish_reason, i // 2, o.sample_index) for i, o in enumerate(outputs)], 2)
    rewards = [float(i % 3) for i in range(len(outputs))]
    stats = {}
    for replay in (False, True):
        model = tiny_moe("qwen3_moe", seed=13, dtype=torch.bfloat16, router_std=None)  # the same weights, fresh
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        stats[replay] = grpo_step(model, optimizer, batch, rewards,
                                  routed_experts=[o.routed_experts for o in outputs] if replay else None)
    assert stats[True].mismatch_mean < stats[False].mismatch_mean
    with pytest.raises(ValueError, match="routes for"):
        grpo_step(hf, torch.optim.SGD(hf.parameters(), lr=0.0), batch, rewards, routed_experts=[None])
