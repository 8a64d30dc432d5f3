"""The engine bound to a megatron-core GPTModel trains along with it (issue: trainer coupling)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams  # noqa: E402
from inference.models.dense.decoder import DenseDecoder  # noqa: E402
from tests.reference import float64_everywhere  # noqa: E402
from tests.support.megatron_cpu import build_gpt_model, gpt_logits, megatron_cpu  # noqa: E402
from tests.weight_sync.paged import tiny_spec  # noqa: E402
from weight_sync.megatron.model import MEGATRON_ADAPTER, bind_megatron_model, spec_from_gpt_model  # noqa: E402


@torch.no_grad()
def megatron_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(gpt_logits(model, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def float64_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The log-probs of `tokens` after `prompt` under `model`'s weights, megatron computing in float64."""
    twin = build_gpt_model(tiny_spec(), seed=0).double().eval()  # NOTE: a megatron model does not deepcopy
    twin.load_state_dict(model.state_dict())
    with float64_everywhere():
        logits = gpt_logits(twin, torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_engine_follows_a_megatron_model_through_a_training_step():
    with megatron_cpu(seed=0):
        gpt = build_gpt_model(tiny_spec(), seed=0).eval()  # 2 query groups: q/k/v are converted copies
        spec = spec_from_gpt_model(gpt)
        engine = DynamicInferenceEngine(DenseDecoder(spec, dict(bind_megatron_model(gpt))), InferenceConfig(
            block_size=4, num_blocks=64, max_requests=4, max_batch_tokens=64, max_sequence_length=64))
        with pytest.raises(TypeError, match="MEGATRON_ADAPTER"):  # NOTE: explicit: no adapter is found by itself
            engine.bind_trainer_model(gpt)
        report = engine.bind_trainer_model(gpt, adapter=MEGATRON_ADAPTER)
        assert report.aliased and any("q_proj" in n for n in report.copied)  # said loudly, not hidden
        prompts = [[5, 9, 14, 3, 7], [11, 2, 8]]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

        def check(version: int) -> None:
            for prompt, out in zip(prompts, engine.generate(prompts, params)):
                assert out.generated_token_ids == megatron_greedy(gpt, prompt, 8)
                want = float64_logprobs(gpt, prompt, out.generated_token_ids)
                # NOTE: |log p| < 6, half an fp32 ulp there 2.4e-7; measured max 3.6e-7; 5e-6 is 14x
                assert (torch.tensor(out.logprobs, dtype=torch.float64) - want).abs().max() < 5e-6
                assert set(out.token_versions) == {version}

        check(0)
        gpt.train()
        optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
        batch = torch.randint(0, spec.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
        logits = gpt_logits(gpt, batch)
        F.cross_entropy(logits[:, :-1].reshape(-1, spec.vocab_size).float(), batch[:, 1:].reshape(-1)).backward()
        optimizer.step()
        gpt.eval()
        assert engine.on_weights_updated() == 1
        check(1)
