"""`bind_megatron_tensors` without megatron: which names alias, which copy, and `refresh()`."""

from __future__ import annotations

import pytest
import torch

from tests.weight_sync.paged import random_hf_tensors, tiny_spec
from weight_sync.megatron.model import bind_megatron_tensors
from weight_sync.megatron.names import WeightNameError, hf_to_megatron, megatron_to_hf


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_aliases_follow_in_place_updates_and_refresh_rewrites_copies(num_kv_heads):
    spec = tiny_spec(num_kv_heads=num_kv_heads, qkv_bias=True)
    params = {"module." + n: t for n, t in hf_to_megatron(random_hf_tensors(spec), spec).items()}
    binding = bind_megatron_tensors(params, spec)
    qkv = {n for n in spec.weight_shapes() if any(f"self_attn.{x}_proj" in n for x in "qkv")}
    assert set(binding.copied) == (qkv if num_kv_heads > 1 else set())
    held = dict(binding)
    with torch.no_grad():
        for t in params.values():
            t.mul_(-2.0)  # an optimizer's in-place step
    fresh = megatron_to_hf(params, spec)
    assert all(torch.equal(binding[n], fresh[n]) for n in binding.aliased)
    assert all(not torch.equal(binding[n], fresh[n]) for n in binding.copied)
    assert sorted(binding.refresh()) == sorted(binding.copied)
    assert all(torch.equal(binding[n], fresh[n]) and binding[n] is held[n] for n in binding)


def test_incomplete_parameters_are_refused():
    spec = tiny_spec()
    params = hf_to_megatron(random_hf_tensors(spec), spec)
    del params["decoder.final_layernorm.weight"]
    with pytest.raises(WeightNameError, match="missing"):
        bind_megatron_tensors(params, spec)
