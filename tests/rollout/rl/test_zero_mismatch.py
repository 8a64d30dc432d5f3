"""`rollout grpo --zero-mismatch` (`rollout.rl.zero_mismatch`): the trainer's log-probs, recomputed by
the engine's kernels from the weights, equal the sampled ones bit for bit; the step's gradients are
torch's autograd of the policy; the demo learns with a mismatch of 0."""

from __future__ import annotations

import random

import pytest
import torch

from inference import LogprobsMode, SamplingParams, native
from rollout import RolloutEngine
from rollout.rl.colocated import GRPOConfig, build_policy, engine_config, run_grpo
from rollout.rl.grpo import gather_logprobs, predicting_logits
from rollout.rl.zero_mismatch import engine_logprobs, with_exact_values

needs_kernels = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def _sampled(cfg: GRPOConfig, prompts: int = 8, n: int = 8):
    torch.manual_seed(cfg.seed)
    policy, task, pad_id = build_policy(cfg)
    engine = RolloutEngine(policy, engine_config(cfg, task))  # NOTE: aliases the policy's weights, as colocated
    problems = task.sample(random.Random(0), prompts)
    sampling = SamplingParams(temperature=1.0, max_tokens=task.max_tokens, logprobs_mode=LogprobsMode.RAW, seed=3)
    batch = engine.generate([p.prompt_ids for p in problems], n=n, sampling=sampling)
    return policy, engine, batch, pad_id


@needs_kernels
def test_the_trainer_s_log_probs_are_the_sampled_ones_on_64_sequences():
    policy, engine, batch, pad_id = _sampled(GRPOConfig(zero_mismatch=True))
    padded = batch.to_padded_tensors(pad_id=pad_id)
    exact = engine_logprobs(engine.engine, batch)
    assert len(batch) == 64 and torch.equal(exact[padded.loss_mask], padded.old_logprobs[padded.loss_mask])


@needs_kernels
def test_the_exact_values_carry_torch_s_gradients():
    policy, engine, batch, pad_id = _sampled(GRPOConfig(zero_mismatch=True), prompts=4, n=4)
    padded = batch.to_padded_tensors(pad_id=pad_id)
    exact = engine_logprobs(engine.engine, batch)[padded.loss_mask]
    weights = torch.linspace(-1.0, 1.0, exact.numel())

    def grads(substitute: bool):
        policy.zero_grad(set_to_none=True)
        logits, targets = predicting_logits(policy, padded.input_ids, padded.loss_mask)
        lp = gather_logprobs(logits, targets)
        out = with_exact_values(lp, exact) if substitute else lp
        if substitute:
            assert torch.equal(out.detach(), exact)  # NOTE: the loss sees the engine kernels' values
        (out * weights).sum().backward()
        return [p.grad.clone() for p in policy.parameters()]

    for ours, torch_s in zip(grads(True), grads(False)):
        torch.testing.assert_close(ours, torch_s, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="differ"):
        with_exact_values(torch.zeros(3), torch.zeros(4))


def test_the_config_takes_it_where_the_mode_holds():
    assert engine_config(GRPOConfig(zero_mismatch=True), build_policy(GRPOConfig())[1]).batch_invariant
    with pytest.raises(ValueError, match="temperature 1"):
        GRPOConfig(zero_mismatch=True, temperature=0.7)
    with pytest.raises(ValueError, match="no LoRA"):
        GRPOConfig(zero_mismatch=True, lora_rank=4)


@needs_kernels
@pytest.mark.slow
def test_the_demo_learns_with_zero_mismatch(tmp_path):
    """The default demo under --zero-mismatch: it learns as the default does and every sampled token's
    trainer log-prob is the engine's, bit for bit (mismatch 0, no token differing)."""
    cfg = GRPOConfig(threads=1, out_dir=str(tmp_path), run_name="zero", wandb=False, progress=False,
                     table_every=50, zero_mismatch=True)
    summary = run_grpo(cfg)
    assert summary.final_reward >= 0.95, summary
    assert summary.mismatch_max == 0.0 and summary.mismatched_tokens == 0
    assert summary.stale_tokens == 0 and summary.cross_version_hits == 0


@needs_kernels
@pytest.mark.stress  # ~90 s a seed on 2 cores
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_demo_learns_with_zero_mismatch_over_seeds(tmp_path, seed):
    cfg = GRPOConfig(threads=1, out_dir=str(tmp_path), run_name=f"zero-{seed}", wandb=False, progress=False,
                     table_every=50, zero_mismatch=True, seed=seed)
    summary = run_grpo(cfg)
    assert summary.final_reward >= 0.95 and summary.mismatch_max == 0.0 and summary.mismatched_tokens == 0, summary
