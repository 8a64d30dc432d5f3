"""Test helpers: engines of a tiny Llama, and `LocalControl`, `weight_sync.WeightControl` made on
an in-process `WeightReceiver` (what a server does on its receiver's worker)."""

from __future__ import annotations

from typing import Any

import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from weight_sync.receiver import WeightReceiver

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13], [1, 7, 7], [2, 3, 4, 5, 6, 7]]


def tiny_llama(seed: int, vocab: int = 64, hidden: int = 32, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def engine_of(model) -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_pretrained(model, InferenceConfig(block_size=4, num_blocks=64, max_requests=8,
                                                                         max_batch_tokens=64, max_sequence_length=64))


def outputs(engine) -> list[list[int]]:
    return [o.generated_token_ids for o in engine.generate(PROMPTS, GREEDY)]


class LocalControl:
    """`WeightControl` over an in-process receiver (each call applies at once, in the caller's thread)."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver

    def join_group(self, master_address, master_port, rank_offset, world_size, group_name="weight_update_group",
                   backend=None, *, timeout_s=None):
        return self.receiver.init_group(master_address, master_port, rank_offset, world_size, group_name, backend,
                                        timeout_s)

    def leave_group(self, group_name="weight_update_group"):
        return self.receiver.destroy_group(group_name)

    def update(self, source, policy=None) -> Any:
        return self.receiver.update(source, policy)

    def weight_version(self) -> int:
        return self.receiver.engine.policy_version

    def update_lora(self, source) -> int:
        """An adapter-only sync, on the receiver's worker as a server runs it (its typed errors)."""
        return self.receiver.apply_lora(source).result(30).version


def corrupting_pipeline(bucket: int):
    """(`WeightGroup.pipeline` that flips one bit of bucket `bucket`'s first piece on the trainer's
    side, after its checksum went out in the manifest; the real one). Other ranks are unchanged."""
    from weight_sync.transports.distributed import WeightGroup

    real = WeightGroup.pipeline
    calls = []

    def flipped(pieces):
        for k, piece in enumerate(pieces):
            if k == 0:
                piece = piece.clone()
                piece[3] ^= 0x40
            yield piece

    def pipeline(self, pieces, on_piece=None):
        if self.rank == 0:
            calls.append(1)
            if len(calls) - 1 == bucket:
                pieces = flipped(pieces)
        return real(self, pieces, on_piece)

    return pipeline, real
