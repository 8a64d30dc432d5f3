"""LoRA on an MoE model equals HF + PEFT: the attention projections of every layer, two adapters of
different ranks and the base model mixed in one batch; adapters of the experts (PEFT's
`target_parameters`) and of shared experts are refused with the reason."""

from __future__ import annotations

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.errors import LoRATargetError
from tests.inference.lora.peft_adapters import ALL_LINEAR, greedy_with_logprobs, peft_reference, save_adapter
from tests.inference.models.moe.tiny import tiny_moe

STEPS = 6
PROMPTS = ([5, 17, 99, 42, 7, 300, 12, 8, 77, 150, 3], [250, 4, 88])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(model) -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_pretrained(model, InferenceConfig(
        block_size=4, num_blocks=64, max_requests=8, max_batch_tokens=32, chunked_prefill_size=5,
        max_sequence_length=32, max_loras=2, max_lora_rank=8))


def test_moe_adapters_mixed_with_base_equal_peft(tmp_path):
    base = tiny_moe("qwen3_moe")
    # NOTE: PEFT (on transformers 5) turns any gate/up/down target of an MoE model into
    # target_parameters of the fused experts, so attention is what PEFT adapts here
    adapters = {"attn": save_adapter(base, tmp_path / "a", r=4, alpha=8, targets=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"], seed=1, std=0.2),
                "qv": save_adapter(base, tmp_path / "b", r=8, alpha=8, targets=["q_proj", "v_proj"], seed=2, std=0.2)}
    engine = make_engine(base)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    names = [None, *adapters]
    prompts = [p for _ in names for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, lora_name=n) for n in names
              for _ in PROMPTS]
    references = {None: base, **{n: peft_reference(base, p) for n, p in adapters.items()}}
    runs: dict = {}
    for out, prompt, p in zip(engine.generate(prompts, params), prompts, params):
        tokens, logprobs = greedy_with_logprobs(references[p.lora_name], prompt, STEPS)
        assert out.generated_token_ids == tokens, p.lora_name
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4
        runs.setdefault(tuple(prompt), set()).add(tuple(tokens))
    assert all(len(r) == 3 for r in runs.values())  # each adapter changes every prompt's tokens


def test_adapters_of_experts_are_refused_with_the_reason(tmp_path):
    experts = save_adapter(tiny_moe("qwen3_moe"), tmp_path / "experts", r=4, alpha=8, targets=ALL_LINEAR, seed=3)
    base = tiny_moe("qwen2_moe")
    shared = save_adapter(base, tmp_path / "shared", r=4, alpha=8, targets=r".*shared_expert\.gate_proj", seed=3)
    engine = make_engine(base)
    with pytest.raises(LoRATargetError, match="target_parameters.*MoE experts"):
        engine.load_lora("a", experts)
    with pytest.raises(LoRATargetError, match="shared_expert.gate_proj.*experts and shared experts are not adapted"):
        engine.load_lora("a", shared)
    assert engine.list_loras() == []
