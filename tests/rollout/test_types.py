"""RolloutBatch as plain data, and its padded-tensor view."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.types import FinishReason, Rollout, RolloutBatch, group_slices


def make_rollout(prompt, completion, group, version=0):
    return Rollout(
        prompt_ids=list(prompt), completion_ids=list(completion),
        logprobs=[-0.5 - i for i in range(len(completion))], versions=[version] * len(completion),
        finish_reason=FinishReason.STOP, group=group,
    )


def test_rollout_rejects_misaligned_token_lists():
    with pytest.raises(ValueError, match="one entry per token"):
        Rollout([1], [3, 4], [-1.0], [0, 0], FinishReason.STOP, group=0)


def test_padded_tensors_layout():
    batch = RolloutBatch([make_rollout([1, 3], [4, 5, 2], 0), make_rollout([1, 3, 4, 5], [6], 1, version=7)], 1)
    p = batch.to_padded_tensors(pad_id=0)
    assert p.input_ids.tolist() == [[1, 3, 4, 5, 2], [1, 3, 4, 5, 6]]
    assert p.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert p.loss_mask.tolist() == [[False, False, True, True, True], [False, False, False, False, True]]
    assert p.old_logprobs[0, 2:].tolist() == [-0.5, -1.5, -2.5]
    assert p.versions.tolist() == [[-1, -1, 0, 0, 0], [-1, -1, -1, -1, 7]]
    assert p.input_ids.dtype == torch.int64 and p.loss_mask.dtype == torch.bool
    assert p.old_logprobs.dtype == torch.float32


def test_padded_tensors_pads_on_the_right_and_rejects_overlong():
    batch = RolloutBatch([make_rollout([1], [3], 0), make_rollout([1, 3, 4], [5, 6, 2], 1)], 1)
    p = batch.to_padded_tensors(pad_id=9)
    assert p.input_ids[0].tolist() == [1, 3, 9, 9, 9, 9]
    assert p.attention_mask[0].tolist() == [1, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="max_length"):
        batch.to_padded_tensors(max_length=5)
    with pytest.raises(ValueError, match="empty"):
        RolloutBatch([], 1).to_padded_tensors()


samples = st.lists(
    st.tuples(st.lists(st.integers(3, 15), min_size=1, max_size=6), st.lists(st.integers(2, 15), max_size=6)),
    min_size=1, max_size=8,
)


@given(samples)
@settings(max_examples=60, deadline=None)
def test_padded_tensors_round_trip(rows):
    batch = RolloutBatch([make_rollout(p, c, g) for g, (p, c) in enumerate(rows)], 1)
    p = batch.to_padded_tensors()
    assert p.input_ids.shape == (len(rows), max(len(a) + len(b) for a, b in rows))
    assert int(p.loss_mask.sum()) == sum(len(c) for _, c in rows)
    assert int(p.attention_mask.sum()) == sum(len(a) + len(b) for a, b in rows)
    assert not p.loss_mask[:, 0].any()  # the first token is always prompt
    assert p.old_logprobs[p.loss_mask].tolist() == [lp for r in batch for lp in r.logprobs]
    assert p.input_ids[p.loss_mask].tolist() == [t for r in batch for t in r.completion_ids]
    for row, r in enumerate(batch):
        assert p.input_ids[row, : r.num_tokens].tolist() == r.prompt_ids + r.completion_ids


@given(st.lists(st.integers(0, 3), max_size=20))
def test_group_slices_cover_runs(groups):
    slices = group_slices(groups)
    assert sum(e - s for s, e in slices) == len(groups)
    for s, e in slices:
        assert len(set(groups[s:e])) == 1
    for (_, e), (s2, _) in zip(slices, slices[1:]):
        assert e == s2 and groups[e - 1] != groups[s2]


def test_batch_views():
    batch = RolloutBatch([make_rollout([1], [3, 2], 0), make_rollout([1], [4], 0, version=1)], 2)
    assert len(batch) == 2 and batch.num_groups == 1 and batch.groups == [0, 0]
    assert batch.completion_lengths == [2, 1] and batch.versions == {0, 1}
