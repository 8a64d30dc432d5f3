"""`update_weights` through the engine: a partial update (HF names) and megatron-core names.

Each update must leave the engine generating exactly what a fresh engine built from the target
weights generates, under one new version, with nothing served from the old cache. The checks
are run once more against planted bugs and must catch them.
"""

from __future__ import annotations

import copy

import pytest

import weight_sync.megatron.model as megatron_model
from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.errors import WeightNameError
from tests.inference.engine.conftest import random_prompts, tiny_llama
from weight_sync.megatron.names import hf_to_megatron

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(4, 5, 14, seed=71)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def config() -> InferenceConfig:
    return InferenceConfig(block_size=4, num_blocks=128, max_requests=8, max_batch_tokens=64, max_sequence_length=64)


def generated(engine):
    outs = engine.generate(PROMPTS, PARAMS)
    versions = {v for o in outs for v in o.token_versions}
    return [o.generated_token_ids for o in outs], [o.logprobs for o in outs], versions


def check_update(old_model, target_model, named_tensors, *, partial, adapter=None):
    """Update an engine of `old_model` with `named_tensors`; it must behave as `target_model`."""
    engine = DynamicInferenceEngine.from_pretrained(old_model, config())
    before, _, _ = generated(engine)
    version = engine.update_weights(named_tensors, partial=partial, adapter=adapter)
    assert version == engine.policy_version == 1
    tokens, logprobs, versions = generated(engine)
    want_tokens, want_logprobs, _ = generated(DynamicInferenceEngine.from_pretrained(target_model, config()))
    assert tokens != before, "the update changed nothing the engine generates"
    assert tokens == want_tokens and versions == {1}
    assert logprobs == want_logprobs  # the same weights through the same code: the same floats
    assert engine.stats()["cross_version_prefix_hits"] == 0


@pytest.fixture(scope="module")
def old():
    return tiny_llama(seed=11)


@pytest.fixture(scope="module")
def new():
    return tiny_llama(seed=12)


def layer_one_and_head(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if n.startswith("model.layers.1.") or n == "lm_head.weight"}


def test_a_partial_update_changes_only_what_it_names(old, new):
    subset = layer_one_and_head(new)
    target = copy.deepcopy(old)
    target.load_state_dict(subset, strict=False)
    check_update(old, target, subset, partial=True)
    with pytest.raises(WeightNameError, match="partial=True"):
        DynamicInferenceEngine.from_pretrained(old, config()).update_weights(subset)


def test_megatron_core_names_update_the_engine(old, new):
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    hf = {n: p.detach() for n, p in new.named_parameters()}
    megatron = hf_to_megatron(hf, engine.model.spec)
    with pytest.raises(WeightNameError, match="MEGATRON_ADAPTER"):  # NOTE: explicit: no adapter is found by itself
        engine.update_weights(megatron)
    check_update(old, new, megatron, partial=False, adapter=megatron_model.MEGATRON_ADAPTER)


def test_a_partial_megatron_bucket(old, new):
    spec = DynamicInferenceEngine.from_pretrained(old, config()).model.spec
    subset = layer_one_and_head(new)
    bucket = hf_to_megatron(subset, spec, complete=False)
    assert all(n.startswith("decoder.layers.1.") or n == "output_layer.weight" for n in bucket)
    target = copy.deepcopy(old)
    target.load_state_dict(subset, strict=False)
    check_update(old, target, bucket, partial=True, adapter=megatron_model.MEGATRON_ADAPTER)


@pytest.fixture
def planted_update_not_applied(monkeypatch):
    """Planted bug: a partial update is validated and versioned but never copied in."""
    monkeypatch.setattr("inference.weights.manager.WeightManager.apply_update", lambda self, hf: None)


@pytest.fixture
def planted_gate_up_swapped(monkeypatch):
    """Planted bug: megatron's fused gate/up projection is split the wrong way round."""
    to_hf = megatron_model.megatron_to_hf

    def swapped(named, spec, complete=True):
        hf = to_hf(named, spec, complete=complete)
        for name in [n for n in hf if n.endswith("mlp.gate_proj.weight")]:
            up = name.replace("gate_proj", "up_proj")
            hf[name], hf[up] = hf[up], hf[name]
        return hf

    monkeypatch.setattr(megatron_model, "megatron_to_hf", swapped)


def test_the_partial_update_check_catches_an_update_not_applied(old, new, planted_update_not_applied):
    with pytest.raises(AssertionError, match="changed nothing"):
        test_a_partial_update_changes_only_what_it_names(old, new)


def test_the_megatron_check_catches_swapped_gate_and_up(old, new, planted_gate_up_swapped):
    with pytest.raises(AssertionError):
        test_megatron_core_names_update_the_engine(old, new)
