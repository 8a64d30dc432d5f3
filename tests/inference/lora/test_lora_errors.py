"""Bad adapters and bad adapter use are typed errors that change nothing: the engine serves on.

Also the PIN policy: a request finishes on the adapter version it was added under, however often
the adapter is reloaded meanwhile, and that version is freed when its last request ends.
"""

from __future__ import annotations

import json
import os

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.errors import (
    LoRACapacityError,
    LoRAError,
    LoRAInUseError,
    LoRALoadError,
    LoRANotFoundError,
    LoRAShapeError,
    LoRATargetError,
)
from tests.inference.lora.peft_adapters import ALL_LINEAR, greedy_with_logprobs, peft_reference, save_adapter
from tests.inference.models.dense.test_decoder_parity import tiny_hf
from tests.inference.models.hybrid.tiny import tiny_hybrid

PROMPT = [5, 17, 99, 42, 7, 300, 12, 8, 77]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def base():
    return tiny_hf("llama")


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return save_adapter(base, tmp_path_factory.mktemp("good") / "a", r=4, alpha=8, targets=ALL_LINEAR, seed=1)


def make_engine(model, **overrides) -> DynamicInferenceEngine:
    fields = dict(block_size=4, num_blocks=64, max_requests=8, max_batch_tokens=32, chunked_prefill_size=8,
                  max_sequence_length=32, max_loras=2, max_lora_rank=8)
    fields.update(overrides)
    return DynamicInferenceEngine.from_pretrained(model, InferenceConfig(**fields))


def serves(engine, expected) -> None:
    (out,) = engine.generate([PROMPT], GREEDY)
    assert out.generated_token_ids == expected


def bad_adapters(base, root):
    """(path, error type, words the message must hold) for each kind of bad adapter."""
    wider = tiny_hf("llama", hidden_size=96, head_dim=24)  # same module names, other shapes
    cases = [
        (save_adapter(wider, root / "shapes", r=4, alpha=8, targets=ALL_LINEAR, seed=2), LoRAShapeError, "A must be"),
        (save_adapter(base, root / "embed", r=4, alpha=8, targets=["q_proj", "embed_tokens"], seed=3),
         LoRATargetError, "embed_tokens"),
        (save_adapter(base, root / "head", r=4, alpha=8, targets=["lm_head"], seed=3), LoRATargetError, "lm_head"),
        (save_adapter(base, root / "dora", r=4, alpha=8, targets=["q_proj"], seed=3, use_dora=True),
         LoRATargetError, "DoRA"),
        (save_adapter(base, root / "rank", r=16, alpha=8, targets=["q_proj"], seed=4), LoRACapacityError,
         "max_lora_rank"),
        (root / "missing", LoRALoadError, "does not exist"),
    ]
    no_weights = save_adapter(base, root / "no_weights", r=4, alpha=8, targets=["q_proj"], seed=5)
    os.remove(no_weights / "adapter_model.safetensors")
    cases.append((no_weights, LoRALoadError, "adapter_model.safetensors"))
    no_config = save_adapter(base, root / "no_config", r=4, alpha=8, targets=["q_proj"], seed=5)
    os.remove(no_config / "adapter_config.json")
    cases.append((no_config, LoRALoadError, "adapter_config.json"))
    not_lora = save_adapter(base, root / "not_lora", r=4, alpha=8, targets=["q_proj"], seed=5)
    config = json.loads((not_lora / "adapter_config.json").read_text())
    (not_lora / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    cases.append((not_lora, LoRALoadError, "not LORA"))
    for case, edit in (("r", {"r": 8}), ("rank_pattern", {"rank_pattern": {"layers.1.self_attn.q_proj": 2}})):
        wrong = save_adapter(base, root / f"wrong_{case}", r=4, alpha=8, targets=["q_proj"], seed=6)
        config = json.loads((wrong / "adapter_config.json").read_text())
        (wrong / "adapter_config.json").write_text(json.dumps({**config, **edit}))
        claimed = edit.get("r") or 2
        cases.append((wrong, LoRAShapeError, f"rank 4 in its tensors but rank {claimed} in its adapter_config.json"))
    return cases


def test_bad_adapters_are_typed_errors_and_the_engine_serves_on(base, good, tmp_path):
    engine = make_engine(base)
    (plain,) = engine.generate([PROMPT], GREEDY)
    for path, error, words in bad_adapters(base, tmp_path):
        with pytest.raises(error, match=words):
            engine.load_lora("bad", path)
        assert engine.list_loras() == []
        serves(engine, plain.generated_token_ids)
    engine.load_lora("a", good)
    engine.load_lora("b", good)
    with pytest.raises(LoRACapacityError, match="max_loras=2"):
        engine.load_lora("c", good)
    with pytest.raises(LoRANotFoundError, match="'c' is not loaded"):
        engine.generate([PROMPT], SamplingParams(max_tokens=2, lora_name="c"))
    with pytest.raises(LoRANotFoundError):
        engine.unload_lora("c")
    engine.unload_lora("b")
    assert [i.name for i in engine.list_loras()] == ["a"]
    expected, _ = greedy_with_logprobs(peft_reference(base, good), PROMPT, GREEDY.max_tokens)
    (out,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora_name="a"))
    assert out.generated_token_ids == expected
    serves(engine, plain.generated_token_ids)
    with pytest.raises(ValueError, match="lora_name"):
        SamplingParams(lora_name="")


def test_hybrid_models_refuse_adapters_with_the_reason(good):
    engine = DynamicInferenceEngine.from_pretrained(tiny_hybrid("bamba"), InferenceConfig(
        block_size=4, num_blocks=32, max_requests=4, max_batch_tokens=32, max_sequence_length=32))
    with pytest.raises(LoRATargetError, match="hybrid"):
        engine.load_lora("a", good)


def test_requests_finish_on_the_version_they_started_with(base, good, tmp_path):
    engine = make_engine(base)
    v2 = save_adapter(base, tmp_path / "v2", r=2, alpha=8, targets=ALL_LINEAR, seed=7)
    engine.load_lora("a", good)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora_name="a")
    first = engine.submit(PROMPT, params)
    for _ in range(3):
        engine.step()
    assert engine.load_lora("a", v2).version == 2  # a reload while version 1 is in flight
    with pytest.raises(LoRAInUseError, match="1 requests in flight"):
        engine.unload_lora("a")
    assert engine.core.loras.resident_versions == 2
    second = engine.submit(PROMPT, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.loras.resident_versions == 1  # version 1 freed with its last request
    (out1,), (out2,) = first.result(5), second.result(5)
    for out, path in ((out1, good), (out2, v2)):
        tokens, logprobs = greedy_with_logprobs(peft_reference(base, path), PROMPT, 6)
        assert out.generated_token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4
    assert out1.generated_token_ids != out2.generated_token_ids
    engine.unload_lora("a")
    assert engine.core.loras.resident_versions == 0 and engine.core.loras.adapter_bytes == 0


def test_every_adapter_error_is_a_lora_error_with_an_http_status():
    for error in (LoRALoadError, LoRAShapeError, LoRATargetError, LoRACapacityError, LoRAInUseError):
        assert issubclass(error, LoRAError) and error.http_status == 400
    assert LoRANotFoundError.http_status == 404
