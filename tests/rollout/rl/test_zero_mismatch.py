"""`rollout grpo --zero-mismatch` (`rollout.rl.zero_mismatch`): the trainer's forward on the engine's
kernels gives the sampled log-probs bit for bit; its gradients are torch's autograd of the policy; the
demo learns with a mismatch of 0."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from inference import LogprobsMode, SamplingParams, native
from inference.models.dense.training import TrainingForward
from rollout import RolloutEngine
from rollout.rl.colocated import GRPOConfig, build_policy, engine_config, run_grpo
from rollout.rl.grpo import gather_logprobs, predicting_logits, token_entropy
from rollout.rl.lora_policy import ADAPTER_NAME, ALL_LINEAR, ColocatedLoRA, lora_config
from rollout.rl.zero_mismatch import engine_kernels_forward

needs_kernels = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def _sampled(cfg: GRPOConfig, prompts: int = 8, n: int = 8):
    torch.manual_seed(cfg.seed)
    policy, task, pad_id = build_policy(cfg)
    engine = RolloutEngine(policy, engine_config(cfg, task))  # NOTE: aliases the policy's weights, as colocated
    problems = task.sample(random.Random(0), prompts)
    mode = LogprobsMode.RAW if cfg.temperature == 1.0 else LogprobsMode.PROCESSED  # NOTE: as the loop asks
    sampling = SamplingParams(temperature=cfg.temperature, max_tokens=task.max_tokens, logprobs_mode=mode, seed=3)
    batch = engine.generate([p.prompt_ids for p in problems], n=n, sampling=sampling)
    return policy, engine, batch, pad_id


@needs_kernels
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_trainer_s_log_probs_are_the_sampled_ones_on_64_sequences(temperature):
    """The trainer's forward on the engine's kernels gives each sampled token its sampled log-prob, bit for
    bit (RAW at temperature 1, PROCESSED at 0.7); the plain forward (torch's kernels) does not."""
    policy, engine, batch, pad_id = _sampled(GRPOConfig(zero_mismatch=True, temperature=temperature))
    padded = batch.to_padded_tensors(pad_id=pad_id)
    logits, lp, targets = engine_kernels_forward(engine, policy, temperature)(padded.input_ids, padded.loss_mask)
    old = padded.old_logprobs[padded.loss_mask]
    assert len(batch) == 64 and lp.requires_grad and torch.equal(lp.detach(), old)
    plain_logits, plain_targets = predicting_logits(policy, padded.input_ids, padded.loss_mask, temperature)
    assert torch.equal(targets, plain_targets) and logits.shape == plain_logits.shape
    assert not torch.equal(gather_logprobs(plain_logits, plain_targets).detach(), old)


@needs_kernels
def test_in_bf16_too():
    """The policy in bf16, the engine aliasing it in bf16: the same bits, on 64 sequences."""
    cfg = GRPOConfig(zero_mismatch=True)
    torch.manual_seed(cfg.seed)
    policy, task, pad_id = build_policy(cfg)
    policy.to(torch.bfloat16)
    engine = RolloutEngine(policy, dataclasses.replace(engine_config(cfg, task), dtype=torch.bfloat16))
    sampling = SamplingParams(temperature=1.0, max_tokens=task.max_tokens, logprobs_mode=LogprobsMode.RAW, seed=5)
    batch = engine.generate([p.prompt_ids for p in task.sample(random.Random(1), 8)], n=8, sampling=sampling)
    padded = batch.to_padded_tensors(pad_id=pad_id)
    logits, lp, _ = engine_kernels_forward(engine, policy)(padded.input_ids, padded.loss_mask)
    assert engine.engine.model.dtype == torch.bfloat16 and len(batch) == 64
    assert torch.equal(lp.detach(), padded.old_logprobs[padded.loss_mask])
    lp.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in policy.parameters())


@needs_kernels
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_its_gradients_are_torch_s_autograd_of_the_policy(temperature):
    """Gradients taken through the engine-kernel forward (its log-probs and its logits, as the entropy
    bonus uses them) match torch's autograd of the plain model within fp32 rounding, every parameter."""
    policy, engine, batch, pad_id = _sampled(GRPOConfig(zero_mismatch=True, temperature=temperature), prompts=4, n=4)
    padded = batch.to_padded_tensors(pad_id=pad_id)
    forward = engine_kernels_forward(engine, policy, temperature)

    def grads(ours: bool):
        policy.zero_grad(set_to_none=True)
        if ours:
            logits, lp, _ = forward(padded.input_ids, padded.loss_mask)
        else:
            logits, targets = predicting_logits(policy, padded.input_ids, padded.loss_mask, temperature)
            lp = gather_logprobs(logits, targets)
        weights = torch.linspace(-1.0, 1.0, lp.numel())
        ((lp * weights).sum() + 0.1 * token_entropy(logits).sum()).backward()
        return {name: p.grad.clone() for name, p in policy.named_parameters()}

    ours, torch_s = grads(True), grads(False)
    assert ours.keys() == torch_s.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], torch_s[name], rtol=1e-5, atol=1e-5 * float(torch_s[name].abs().max()),
                                   msg=name)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_a_lora_adapter_shared_with_the_engine(dtype):
    """Colocated LoRA: the engine serves the trainer's PEFT adapter (aliased, B made non-zero here so that
    it changes the samples); the forward's log-probs are the sampled ones bit for bit and the adapter's
    gradients are torch's autograd of the PEFT model (fp32)."""
    cfg = GRPOConfig(zero_mismatch=True, lora_rank=4)
    torch.manual_seed(cfg.seed)
    policy, task, pad_id = build_policy(cfg)
    policy.to(dtype)
    engine = RolloutEngine(policy, dataclasses.replace(engine_config(cfg, task), dtype=dtype))
    from peft import get_peft_model

    peft_model = get_peft_model(policy, lora_config(4, 8.0, ALL_LINEAR)).to(dtype)  # NOTE: PEFT makes fp32 LoRAs
    lora = ColocatedLoRA(engine, peft_model, engine.load_lora_from_peft(ADAPTER_NAME, peft_model, share=True))
    lora.check_aliased()
    with torch.no_grad():
        for name, p in lora.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    lora.updated()
    sampling = SamplingParams(temperature=1.0, max_tokens=task.max_tokens, logprobs_mode=LogprobsMode.RAW, seed=4,
                              lora_name=ADAPTER_NAME)
    batch = engine.generate([p.prompt_ids for p in task.sample(random.Random(2), 8)], n=8, sampling=sampling)
    padded = batch.to_padded_tensors(pad_id=pad_id)
    forward = engine_kernels_forward(engine, lora.model, lora=lambda: lora.ref)
    logits, lp, _ = forward(padded.input_ids, padded.loss_mask)
    assert len(batch) == 64 and torch.equal(lp.detach(), padded.old_logprobs[padded.loss_mask])
    base = engine_kernels_forward(engine, lora.model)(padded.input_ids, padded.loss_mask)[1]
    assert not torch.equal(base.detach(), lp.detach())  # NOTE: the adapter counts
    if dtype != torch.float32:
        return
    weights = torch.linspace(-1.0, 1.0, lp.numel())

    def grads(ours: bool):
        lora.model.zero_grad(set_to_none=True)
        if ours:
            logits, lp, _ = forward(padded.input_ids, padded.loss_mask)
        else:
            logits, targets = predicting_logits(lora.model, padded.input_ids, padded.loss_mask)
            lp = gather_logprobs(logits, targets)
        ((lp * weights).sum() + 0.1 * token_entropy(logits).sum()).backward()
        return {name: p.grad.clone() for name, p in lora.model.named_parameters() if p.requires_grad}

    ours, torch_s = grads(True), grads(False)
    assert ours.keys() == torch_s.keys() and len(ours) == 2 * 7 * cfg.num_layers
    for name in ours:
        torch.testing.assert_close(ours[name], torch_s[name], rtol=1e-5, atol=1e-5 * float(torch_s[name].abs().max()),
                                   msg=name)


@needs_kernels
def test_it_runs_only_where_it_can_be_exact():
    policy, engine, batch, pad_id = _sampled(GRPOConfig(zero_mismatch=True), prompts=1, n=1)
    padded = batch.to_padded_tensors(pad_id=pad_id)
    forward = engine_kernels_forward(engine, policy)
    with pytest.raises(ValueError, match="first position"):
        forward(padded.input_ids, torch.ones_like(padded.loss_mask))
    # a copy of the weights is not the trainer's: the gradients would go where the values did not come from
    copies = {name: p.detach().clone() for name, p in policy.named_parameters()}
    with pytest.raises(ValueError, match="not the trainer's parameter"):
        TrainingForward(engine.engine.model, copies, block_size=16)
    other, other_engine, _, _ = _sampled(GRPOConfig(), prompts=1, n=1)
    with pytest.raises(ValueError, match="batch_invariant=True"):
        engine_kernels_forward(other_engine, other)


def test_the_config_takes_it_where_the_mode_holds():
    assert engine_config(GRPOConfig(zero_mismatch=True), build_policy(GRPOConfig())[1]).batch_invariant


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
