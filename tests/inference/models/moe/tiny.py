"""Tiny random MoE models of each supported family (Qwen3-MoE, Qwen2-MoE, Mixtral) for tests."""

from __future__ import annotations

import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 384
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_moe(family: str = "qwen3_moe", seed: int = 0, *, experts: int = 8, top_k: int = 2,
             dtype: torch.dtype = torch.float32, router_std: float | None = 0.3, **overrides) -> torch.nn.Module:
    """A random-init `*ForCausalLM` of `family`: 2 layers, hidden 64, `experts` experts, top-`top_k`.

    The router weights are drawn with std `router_std` (HF initialises them small, which makes
    routing near-uniform and its top-k a coin toss on rounding: `router_std=None` keeps that, for
    tests of routing flips)."""
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**_COMMON, **dict(
            head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=experts,
            num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            use_sliding_window=False), **overrides})
        model = Qwen3MoeForCausalLM(cfg)
    elif family == "qwen2_moe":
        cfg = Qwen2MoeConfig(**{**_COMMON, **dict(
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=False, decoder_sparse_step=1,
            mlp_only_layers=[], use_sliding_window=False), **overrides})
        model = Qwen2MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = MixtralConfig(**{**_COMMON, **dict(
            intermediate_size=32, num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None),
            **overrides})
        model = MixtralForCausalLM(cfg)
    else:
        raise ValueError(f"unknown MoE family {family!r}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if router_std is not None and name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
    return model.to(dtype).eval()
