"""Test helpers: tiny specs and a driver that runs a `DenseDecoder` through its paged KV cache."""

from __future__ import annotations

import random

import torch

from inference.attention.metadata import AttentionMetadata
from inference.models.spec import ModelFamily, ModelSpec

TINY = dict(
    family=ModelFamily.LLAMA,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=112,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)


def tiny_spec(**overrides) -> ModelSpec:
    return ModelSpec(**{**TINY, **overrides})


def random_hf_tensors(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen) for n, shape in spec.weight_shapes().items()}


def engine_logits(model, sequences, prompt_lens, *, block_size=4, chunk=5, seed=0) -> list[torch.Tensor]:
    """Logits of every position of every sequence, as the engine computes them.

    Prompts are prefilled in chunks of at most `chunk` tokens, the rest fed one token per step;
    all requests share one flat batch per step in shuffled order, blocks handed out shuffled.
    """
    rng = random.Random(seed)
    longest = max(len(s) for s in sequences)
    free = list(range(len(sequences) * -(-longest // block_size) + 4))
    rng.shuffle(free)
    cache = model.new_kv_cache(len(free), block_size)
    tables = [[] for _ in sequences]
    done = [0] * len(sequences)
    rows = [[] for _ in sequences]
    while any(d < len(s) for d, s in zip(done, sequences)):
        order = [r for r in range(len(sequences)) if done[r] < len(sequences[r])]
        rng.shuffle(order)
        ids, pos, q_lens, seq_lens, req_tables = [], [], [], [], []
        for r in order:
            n = min(chunk, prompt_lens[r] - done[r]) if done[r] < prompt_lens[r] else 1
            while len(tables[r]) * block_size < done[r] + n:
                tables[r].append(free.pop())
            ids += sequences[r][done[r] : done[r] + n]
            pos += range(done[r], done[r] + n)
            q_lens.append(n)
            seq_lens.append(done[r] + n)
            req_tables.append(tables[r])
            done[r] += n
        meta = AttentionMetadata.build(q_lens, seq_lens, req_tables, block_size, pad_block_id=-1)
        logits = model(torch.tensor(ids), torch.tensor(pos), cache, meta, torch.arange(len(ids)))
        start = 0
        for r, n in zip(order, q_lens):
            rows[r].append(logits[start : start + n])
            start += n
    return [torch.cat(r) for r in rows]
