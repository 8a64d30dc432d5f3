"""Parity of the engine's LoRA with HF + PEFT (adapters applied by PEFT's layers, not merged).

One engine serves three adapters of different ranks and targets (all seven linear projections at
rank 4; q, v and down at rank 8 with rsLoRA scaling; k, o, gate, up of layer 1 only at rank 2)
and the base model, all mixed in one batch: the same prompts under each, prefill chunked so
prefill and decode rows of different adapters share steps, prefix caching on (a block computed
under one adapter must never serve another). Greedy tokens must equal PEFT's and log-probs be
within 1e-4 of them (fp32 both sides); base requests must equal the base model.
"""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from tests.inference.lora.peft_adapters import ALL_LINEAR, greedy_with_logprobs, peft_reference, save_adapter
from tests.inference.models.dense.test_decoder_parity import tiny_hf

TOL = 1e-4
STEPS = 8
PROMPTS = ([5, 17, 99, 42, 7, 300, 12, 8, 77, 150, 3, 61, 19], [250, 4, 88], [31, 32, 33, 34, 35, 36, 37, 38, 39])


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: tiny models: intra-op threads only add synchronisation
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base():
    return tiny_hf("qwen2")  # q/k/v biases: the adapter adds to a biased projection


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {
        "all4": save_adapter(base, root / "all4", r=4, alpha=8, targets=ALL_LINEAR, seed=1),
        "qvd8": save_adapter(base, root / "qvd8", r=8, alpha=4, targets=["q_proj", "v_proj", "down_proj"], seed=2,
                             use_rslora=True),
        "l1r2": save_adapter(base, root / "l1r2", r=2, alpha=4, targets=["k_proj", "o_proj", "gate_proj", "up_proj"],
                             seed=3, layers_to_transform=[1], std=0.3),
    }


def make_engine(model, **overrides) -> DynamicInferenceEngine:
    fields = dict(block_size=4, num_blocks=128, max_requests=16, max_batch_tokens=64, chunked_prefill_size=5,
                  max_sequence_length=64, max_loras=3, max_lora_rank=8)
    fields.update(overrides)
    return DynamicInferenceEngine.from_pretrained(model, InferenceConfig(**fields))


def test_mixed_batch_of_adapters_equals_peft_and_base_equals_hf(base, adapters):
    engine = make_engine(base)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    names = [None, *adapters]
    prompts = [p for _ in names for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, lora_name=name)
              for name in names for _ in PROMPTS]
    outputs = engine.generate(prompts, params)
    references = {None: base, **{name: peft_reference(base, path) for name, path in adapters.items()}}
    worst = 0.0
    runs: dict = {}
    for out, prompt, p in zip(outputs, prompts, params):
        tokens, logprobs = greedy_with_logprobs(references[p.lora_name], prompt, STEPS)
        assert out.generated_token_ids == tokens, (p.lora_name, prompt)
        worst = max(worst, max(abs(a - b) for a, b in zip(out.logprobs, logprobs)))
        runs.setdefault(tuple(prompt), set()).add(tuple(tokens))
    assert worst < TOL
    # NOTE: the adapters must matter, or this test could not fail: each prompt's runs differ
    assert all(len(r) >= 3 for r in runs.values()), runs
    stats = engine.list_loras()
    assert [(i.name, i.version, i.rank, i.requests) for i in stats] == [("all4", 1, 4, 0), ("l1r2", 1, 2, 0),
                                                                          ("qvd8", 1, 8, 0)]


def test_reloaded_adapter_never_serves_blocks_of_its_old_version(base, adapters, tmp_path):
    engine = make_engine(base)
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, lora_name="a")
    engine.load_lora("a", adapters["all4"])
    (first,) = engine.generate([prompt], params)
    cached = engine.core.context.prefix_cached_tokens
    (again,) = engine.generate([prompt], params)
    assert engine.core.context.prefix_cached_tokens > cached  # same adapter and version: its blocks are reused
    assert again.generated_token_ids == first.generated_token_ids
    other = save_adapter(base, tmp_path / "other", r=4, alpha=8, targets=ALL_LINEAR, seed=9)
    assert engine.load_lora("a", other).version == 2
    cached = engine.core.context.prefix_cached_tokens
    (reloaded,) = engine.generate([prompt], params)
    assert engine.core.context.prefix_cached_tokens == cached  # nothing of version 1 matched
    tokens, logprobs = greedy_with_logprobs(peft_reference(base, other), prompt, STEPS)
    assert reloaded.generated_token_ids == tokens != first.generated_token_ids
    assert max(abs(a - b) for a, b in zip(reloaded.logprobs, logprobs)) < TOL


def test_rank_and_alpha_patterns_scale_as_peft_does(base, tmp_path):
    """PEFT's `rank_pattern` / `alpha_pattern` give some modules their own rank and alpha (its
    scaling is each module's alpha / r): the engine follows them module by module."""
    path = save_adapter(base, tmp_path / "patterns", r=4, alpha=8, targets=ALL_LINEAR, seed=4, std=0.3,
                        rank_pattern={"q_proj": 8, "layers.1.mlp.down_proj": 2},
                        alpha_pattern={"v_proj": 32, "layers.0.self_attn.o_proj": 1})
    engine = make_engine(base)
    engine.load_lora("p", path)
    reference = peft_reference(base, path)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, lora_name="p")
    for out, prompt in zip(engine.generate(list(PROMPTS), [params] * len(PROMPTS)), PROMPTS):
        tokens, logprobs = greedy_with_logprobs(reference, prompt, STEPS)
        assert out.generated_token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < TOL
    # NOTE: the patterns must matter, or this test could not fail: without them the tokens differ
    plain = save_adapter(base, tmp_path / "plain", r=4, alpha=8, targets=ALL_LINEAR, seed=4, std=0.3)
    assert greedy_with_logprobs(peft_reference(base, plain), PROMPTS[0], STEPS)[1] != \
        greedy_with_logprobs(reference, PROMPTS[0], STEPS)[1]
