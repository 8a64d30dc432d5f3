"""AttentionMetadata validation and the decode / prefill split."""

from __future__ import annotations

import pytest
import torch

from inference.attention.metadata import AttentionMetadata, split_decode_prefill


def test_build_computes_slots_and_pads_tables():
    meta = AttentionMetadata.build([2, 1], [5, 3], [[7, 2], [4]], block_size=4, pad_block_id=-1)
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.block_tables.tolist() == [[7, 2], [4, -1]]
    # request 0: positions 3, 4 -> block 7 slot 3, block 2 slot 0; request 1: position 2 -> block 4
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_requests, meta.num_tokens) == (2, 5, 2, 3)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("query_start_loc", torch.tensor([0, 1], dtype=torch.int64), "query_start_loc"),
        ("seq_lens", torch.tensor([1, 1], dtype=torch.int32), "query_start_loc has 2"),
        ("block_tables", torch.zeros(2, 1, dtype=torch.int32), "block_tables has 2 rows"),
        ("slot_mapping", torch.zeros(1, dtype=torch.int32), "slot_mapping"),
    ],
)
def test_post_init_names_the_bad_field(field, value, message):
    args = dict(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        max_query_len=1,
        max_seq_len=1,
    )
    args[field] = value
    with pytest.raises(ValueError, match=message):
        AttentionMetadata(**args)


def test_build_rejects_short_tables_and_bad_lengths():
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        AttentionMetadata.build([3], [2], [[0]], block_size=4)


def test_split_interleaved_decode_and_prefill():
    # rows: r0 decode (0), r1 prefill (1..3), r2 decode (4), r3 prefill (5..6)
    meta = AttentionMetadata.build([1, 3, 1, 2], [9, 3, 4, 6], [[0, 1, 2], [3], [4], [5, 6]], block_size=4)
    split = split_decode_prefill(meta)
    assert split.decode_reqs.tolist() == [0, 2] and split.decode_tokens.tolist() == [0, 4]
    assert split.prefill_reqs.tolist() == [1, 3] and split.prefill_tokens.tolist() == [1, 2, 3, 5, 6]
    assert split.decode_seq_lens_cpu.tolist() == [9, 4]
    assert split.prefill_query_lens_cpu.tolist() == [3, 2] and split.prefill_seq_lens_cpu.tolist() == [3, 6]
    assert not split.decode_only and not split.prefill_only


def test_split_single_group():
    decode = split_decode_prefill(AttentionMetadata.build([1, 1], [3, 5], [[0], [1, 2]], block_size=4))
    assert decode.decode_only and decode.prefill_tokens is None
    prefill = split_decode_prefill(AttentionMetadata.build([2], [2], [[0]], block_size=4))
    assert prefill.prefill_only and prefill.decode_tokens is None
