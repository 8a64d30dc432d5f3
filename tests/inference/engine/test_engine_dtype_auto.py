"""`dtype` "auto" (the default, as vLLM's `--dtype auto`): an engine computes in its checkpoint's
dtype, a bf16 checkpoint in bf16, and in fp32 when asked; the same for an in-memory model and for
`rollout serve`'s flag."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


def engine_dtype(model, **config) -> torch.dtype:
    engine = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(block_size=4, num_blocks=32, max_requests=4,
                                                                           max_batch_tokens=64, max_sequence_length=64,
                                                                           **config))
    (out,) = engine.generate([[1, 5, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out.generated_token_ids) == 2
    assert engine.core.config.dtype == engine.model.spec.dtype  # resolved: nothing reads "auto" later
    return engine.model.spec.dtype


def test_a_bf16_checkpoint_runs_in_bf16_by_default_and_fp32_when_asked(tmp_path, one_torch_thread):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model.to(torch.float32).save_pretrained(tmp_path / "fp32")
    assert InferenceConfig().dtype == "auto"
    assert engine_dtype(tmp_path / "bf16") == torch.bfloat16
    assert engine_dtype(tmp_path / "bf16", dtype="float32") == torch.float32
    assert engine_dtype(tmp_path / "fp32") == torch.float32
    assert engine_dtype(model.to(torch.bfloat16)) == torch.bfloat16  # a module's own dtype


def test_rollout_serve_takes_the_checkpoints_dtype_by_default():
    import argparse

    from rollout.server.serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--model", "m"]).dtype == "auto"
    assert parser.parse_args(["--model", "m", "--dtype", "float32"]).dtype == "float32"
