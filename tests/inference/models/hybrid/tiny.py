"""Tiny random hybrid models of each supported family (Bamba, Nemotron-H, Falcon-H1) for tests."""

from __future__ import annotations

import torch
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
)

VOCAB = 384
FAMILIES = ("bamba", "nemotron_h", "falcon_h1")
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_hybrid(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """An fp32 random-init `*ForCausalLM` of `family`: 2 Mamba2 layers around attention, hidden 64."""
    torch.manual_seed(seed)
    if family == "bamba":
        cfg = BambaConfig(**{**_COMMON, **dict(
            num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=1024), **overrides})
        model = BambaForCausalLM(cfg)
    elif family == "nemotron_h":
        cfg = NemotronHConfig(**{**_COMMON, **dict(
            layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"], head_dim=16,
            mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
            max_position_embeddings=1024), **overrides})
        model = NemotronHForCausalLM(cfg)
    elif family == "falcon_h1":
        cfg = FalconH1Config(**{**_COMMON, **dict(
            num_hidden_layers=2, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_state=16, mamba_n_groups=2,
            mamba_chunk_size=16, mamba_rms_norm=True, max_position_embeddings=1024, key_multiplier=0.9,
            attention_in_multiplier=1.1, attention_out_multiplier=0.8, ssm_out_multiplier=1.2,
            ssm_in_multiplier=0.9, ssm_multipliers=[1.0, 0.9, 1.1, 1.0, 0.8], mlp_multipliers=[1.1, 0.9],
            embedding_multiplier=1.3, lm_head_multiplier=0.7), **overrides})
        model = FalconH1ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown hybrid family {family!r}")
    return model.eval()
