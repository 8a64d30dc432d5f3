"""The CPU fast paths of the layers give the reference ops' results bit for bit: the chunked LM head
(`F.linear`), the in-place rotary (`apply_rotary`; native kernel unless ROLLOUT_ENGINE_NO_KERNELS)."""

import pytest
import torch
import torch.nn.functional as F

from inference.models.layers import LM_HEAD_CHUNK, RotaryEmbedding, apply_rotary, apply_rotary_, lm_head
from inference.models.spec import RopeSpec


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 129])
@pytest.mark.parametrize("vocab,hidden", [(LM_HEAD_CHUNK * 3 + 17, 576), (32000, 256), (LM_HEAD_CHUNK - 5, 64)])
def test_lm_head_equals_linear(rows: int, vocab: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    x, w = torch.randn(rows, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen)
    assert torch.equal(lm_head(x, w), F.linear(x, w))


def test_lm_head_other_dtypes_fall_back() -> None:
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(3000, 32).bfloat16()
    assert torch.equal(lm_head(x, w), F.linear(x, w))


@pytest.mark.parametrize("tokens,heads,dim", [(1, 3, 64), (64, 9, 64), (200, 4, 64), (5, 2, 128), (0, 2, 64)])
def test_rotary_in_place_equals_apply_rotary(tokens: int, heads: int, dim: int) -> None:
    rotary = RotaryEmbedding(RopeSpec(theta=100000.0), dim)
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    cos, sin = rotary.cos_sin(torch.randint(0, 8192, (tokens,), generator=gen), torch.float32)
    x = torch.randn(tokens, heads * dim, generator=gen).view(tokens, heads, dim)
    want = apply_rotary(x, cos, sin)
    assert torch.equal(apply_rotary_(x.clone(), cos, sin), want)
