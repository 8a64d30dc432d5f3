"""The CPU shims: what they change inside the block, that they undo it after, the RNG tracker."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core", allow_module_level=True)

# NOTE: megatron's modules come through `megatron_cpu`, whose import silences megatron's import noise
from tests.support.megatron_cpu import (  # noqa: E402
    CpuRNGStatesTracker,
    TransformerConfig,
    build_gpt_model,
    megatron_cpu,
    megatron_random,
    parallel_state,
)
from tests.weight_sync.paged import tiny_spec  # noqa: E402
from weight_sync.megatron.names import spec_from_megatron_config  # noqa: E402


def test_shims_apply_inside_the_block_and_are_undone_after():
    original = torch.cuda.current_device
    had_group = dist.is_initialized()  # a group made elsewhere is used, and left alone after
    with megatron_cpu(seed=3):
        assert torch.cuda.current_device() == torch.device("cpu")
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
        assert isinstance(megatron_random.get_cuda_rng_tracker(), CpuRNGStatesTracker)
        with megatron_cpu():  # re-entrant: the inner exit undoes nothing
            pass
        assert dist.is_initialized()
        build_gpt_model(tiny_spec(num_layers=1))
    assert torch.cuda.current_device is original
    assert dist.is_initialized() == had_group and not parallel_state.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="megatron_cpu"):
        build_gpt_model(tiny_spec())


def test_rng_fork_uses_its_own_stream_and_leaves_the_default_alone():
    with megatron_cpu(seed=7):
        tracker = megatron_random.get_cuda_rng_tracker()
        torch.manual_seed(0)
        expected = torch.rand(4)
        torch.manual_seed(0)
        with tracker.fork():
            first = F.dropout(torch.ones(64), p=0.5)
        with tracker.fork():
            second = F.dropout(torch.ones(64), p=0.5)
        assert torch.equal(torch.rand(4), expected)  # the default stream did not move
        assert not torch.equal(first, second)  # the forked stream did
        with pytest.raises(KeyError):
            with tracker.fork("no-such-stream"):
                pass


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=112,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        cuda_graph_scope=[],
    )
    return TransformerConfig(**{**fields, **overrides})


def test_spec_from_megatron_config():
    spec = spec_from_megatron_config(_config(layernorm_epsilon=1e-5), vocab_size=256, rotary_base=5e5)
    assert (spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps, spec.rope.theta) == (2, 16, 1e-5, 5e5)
    assert not (spec.qkv_bias or spec.o_bias or spec.mlp_bias or spec.qk_norm)


@pytest.mark.parametrize(
    "overrides, kwargs, field",
    [
        ({"normalization": "LayerNorm"}, {}, "normalization"),
        ({"gated_linear_unit": False}, {}, "gated_linear_unit"),
        ({"rotary_interleaved": True}, {}, "rotary_interleaved"),
        ({}, {"rotary_percent": 0.5}, "rotary_percent"),
        ({}, {"position_embedding_type": "learned_absolute"}, "position_embedding_type"),
        ({"softmax_scale": 0.5}, {}, "softmax_scale"),
    ],
)
def test_spec_from_megatron_config_refuses_other_maths(overrides, kwargs, field):
    with pytest.raises(NotImplementedError, match=field):
        spec_from_megatron_config(_config(**overrides), vocab_size=256, **kwargs)
