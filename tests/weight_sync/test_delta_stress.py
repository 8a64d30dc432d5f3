"""Delta syncs of a ~0.5B-parameter random model of a real (Llama) shape, `stress` only (~15
minutes and ~14 GiB on 2 cores, mostly the random gradients and AdamW): an fp32 trainer (AdamW at
lr 1e-6, random gradients: Adam's steps are ~lr whatever their scale) and two bf16 replicas in one
gloo group, one staging double, one in place. After 100 delta syncs both are bitwise the
trainer's bf16 cast and generate what a fresh engine of that cast does."""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams, Staging
from inference.models.dense.decoder import DenseDecoder
from inference.models.spec import ModelFamily, ModelSpec
from tests.weight_sync.local import LocalControl
from weight_sync import Transport, WeightReceiver, WeightSender

pytestmark = [pytest.mark.stress]

SPEC = ModelSpec(family=ModelFamily.LLAMA, vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_layers=28,
                 num_heads=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)  # 491M parameters
CONFIG = InferenceConfig(block_size=16, kv_memory_bytes=16 * 2**20, max_requests=4, max_batch_tokens=64,
                         max_sequence_length=128, dtype=torch.bfloat16)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[1, 500, 7000, 31], [1, 9, 12000]]


def engine(weights: dict[str, torch.Tensor]) -> DynamicInferenceEngine:
    return DynamicInferenceEngine(DenseDecoder(SPEC, weights), CONFIG)


def greedy(e) -> list[list[int]]:
    return [o.generated_token_ids for o in e.generate(PROMPTS, GREEDY)]


def test_a_hundred_delta_syncs_of_a_half_billion_parameter_model_stay_bitwise():
    gen = torch.Generator().manual_seed(0)
    master = {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for n, s in SPEC.weight_shapes().items()}
    assert 0.45e9 < sum(p.numel() for p in master.values()) < 0.55e9
    optimizer = torch.optim.AdamW(master.values(), lr=1e-6)
    engines = [engine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SPEC.weight_shapes().items()})
               for _ in range(2)]
    receivers = [WeightReceiver(engines[0], timeout_s=300),
                 WeightReceiver(engines[1], timeout_s=300, staging=Staging.IN_PLACE)]
    try:
        with WeightSender([LocalControl(r) for r in receivers], Transport.GLOO, delta=True, dtype=torch.bfloat16,
                          timeout_s=300) as sender:
            sender.sync(master)
            for _ in range(100):
                for p in master.values():
                    p.grad = torch.randn(p.shape, generator=gen)
                optimizer.step()
                sender.sync(master)
                assert sender.stats.last_delta
        cast = {n: p.detach().to(torch.bfloat16) for n, p in master.items()}
        for e in engines:
            live = e.model.named_tensors()
            assert all(torch.equal(live[n].view(torch.int16), t.view(torch.int16)) for n, t in cast.items())
        expected = greedy(engine(cast))
        assert [greedy(e) for e in engines] == [expected, expected]
    finally:
        for r in receivers:
            r.close()
