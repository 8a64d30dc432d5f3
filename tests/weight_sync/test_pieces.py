"""How updates are cut into pieces, and the byte moves that carry them.

Property tests: the copy-and-checksum kernel against a plain reference; every tensor byte in
exactly one piece of a segment (shared memory) or of a broadcast (torch.distributed); what a
trainer puts on the wire sums to the manifest's checksums. Then end to end, in one process, with
pieces small enough that tensors are sliced and land straight in the engines' staging buffers.
"""

from __future__ import annotations

import threading
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.weight_sync.local import LocalControl, engine_of, outputs, tiny_llama
from weight_sync import Transport, WeightReceiver, WeightSender, memcopy
from weight_sync.buckets import as_bytes, fill_checksums, manifest_for, word_sum
from weight_sync.sources import MIN_PIECE_BYTES
from weight_sync.transports import bucket_broadcast
from weight_sync.transports.bucket_broadcast import PieceScratch, plan_pieces, wire_bytes
from weight_sync.transports.distributed import WeightGroup
from weight_sync.transports.shm import SegmentPlan

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def reference_sum(data: bytes) -> int:
    data += b"\0" * (-len(data) % 8)
    return sum(int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)) % 2**64


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 3000), src_offset=st.integers(0, 9), dst_offset=st.integers(0, 9), seed=st.integers(0, 99))
def test_copy_sum_copies_and_sums_like_the_reference(size, src_offset, dst_offset, seed):
    data = np.random.default_rng(seed).integers(0, 256, size + 16, dtype=np.uint8)
    src = data[src_offset : src_offset + size]
    dst = np.zeros(size + 16, dtype=np.uint8)[dst_offset : dst_offset + size]
    assert memcopy.copy_sum(dst, src) == reference_sum(src.tobytes()) == memcopy.word_sum(src)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("size", [2**20, 2**20 + 7, 3 * 2**20 + 64])
def test_large_aligned_copies_take_the_streaming_path_and_agree(size):
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = torch.zeros(size, dtype=torch.uint8).numpy()  # 64-byte aligned: streaming stores
    assert memcopy.copy_sum(dst, src) == memcopy.word_sum(src)
    assert np.array_equal(dst, src)


def named_tensors(sizes, dtypes):
    return [(f"t{i}", torch.randn(n).to(dtypes[i % len(dtypes)])) for i, n in enumerate(sizes)]


tensor_sizes = st.lists(st.integers(1, 70_000), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(sizes=tensor_sizes, bucket_kib=st.integers(1, 300), piece_kib=st.sampled_from([64, 128, 320]))
def test_a_segment_plan_covers_every_tensor_byte_once_within_its_pieces(sizes, bucket_kib, piece_kib):
    named = named_tensors(sizes, DTYPES)
    manifest = manifest_for(named, bucket_bytes=bucket_kib * 1024)
    plan = SegmentPlan.of(manifest, piece_kib * 1024)
    assert plan.header_bytes % 4096 == 0 and plan.header_bytes >= 16 * len(plan.pieces)
    assert len(plan.pieces) * plan.piece_bytes >= plan.data_bytes == manifest.total_bytes
    covered = {i: [] for i in range(len(named))}
    for k, spans in enumerate(plan.pieces):
        for i, lo, hi in spans:
            assert k * plan.piece_bytes <= plan.starts[i] + lo < plan.starts[i] + hi <= (k + 1) * plan.piece_bytes
            covered[i].append((lo, hi))
    nbytes = manifest.tensor_bytes()
    for i, spans in covered.items():
        assert sorted(spans)[0][0] == 0 and sorted(spans)[-1][1] == nbytes[i]
        assert all(a[1] == b[0] for a, b in zip(sorted(spans), sorted(spans)[1:]))  # contiguous, no overlap
    done = sorted(b for bs in plan.buckets_done for b in bs)
    assert done == list(range(manifest.num_buckets))


@settings(max_examples=40, deadline=None)
@given(sizes=tensor_sizes, bucket_kib=st.integers(1, 300), small=st.sampled_from([8, 1000, 20_000]),
       piece=st.sampled_from([64, 4096, 40_000]))
def test_broadcast_pieces_cover_every_byte_once_and_sum_to_the_manifest(sizes, bucket_kib, small, piece):
    with mock.patch.object(bucket_broadcast, "SMALL_BYTES", small):
        check_broadcast_pieces(sizes, bucket_kib, small, piece)


def check_broadcast_pieces(sizes, bucket_kib, small, piece):
    named = named_tensors(sizes, DTYPES)
    manifest = manifest_for(named, bucket_bytes=bucket_kib * 1024)
    tensors = [t for _, t in named]
    fill_checksums(manifest, tensors)
    sources = [as_bytes(t) for t in tensors]
    scratch = PieceScratch(torch.device("cpu"))
    nbytes = manifest.tensor_bytes()
    for bucket, pieces in zip(manifest.layout.buckets, plan_pieces(manifest, piece)):
        seen = []
        total = 0
        for p in pieces:
            assert p.nbytes > 0
            if p.packed:
                assert all(lo == 0 and hi == nbytes[i] < small for i, lo, hi in p.spans)  # whole small tensors
            else:  # a slice of a large tensor, or a small one alone
                (i, lo, hi), = p.spans
                assert hi - lo <= piece or (lo == 0 and hi == nbytes[i] < small)
            data = wire_bytes(p, sources, scratch)
            assert data.numel() == p.nbytes
            total += word_sum(data)
            seen += [(i, lo, hi) for i, lo, hi in p.spans]
        assert total % 2**64 == bucket.checksum
        for i in range(bucket.start, bucket.stop):
            spans = sorted((lo, hi) for j, lo, hi in seen if j == i)
            assert spans[0][0] == 0 and spans[-1][1] == nbytes[i]
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


# ---- end to end, one process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=0, vocab=4096), tiny_llama(seed=1, vocab=4096)  # a 512 KiB embedding


@pytest.fixture
def engines(models):
    engines = [engine_of(models[0]), engine_of(models[0])]
    receivers = [WeightReceiver(e, timeout_s=3.0) for e in engines]
    yield engines, receivers
    for r in receivers:
        r.close()


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
def test_sliced_pieces_land_in_the_engines_own_buffers(engines, models, transport, monkeypatch):
    engines, receivers = engines
    expected = outputs(engine_of(models[1]))
    monkeypatch.setattr(bucket_broadcast, "SMALL_BYTES", 4096)  # big tensors go straight in, in slices
    monkeypatch.setattr(bucket_broadcast, "PIECE_BYTES", 64 * 1024)
    handed = {}
    for i, e in enumerate(engines):
        real = e.staging_buffers
        e.staging_buffers = lambda names, real=real, i=i: handed.setdefault(i, real(names))
    with WeightSender([LocalControl(r) for r in receivers], transport, timeout_s=3.0, bucket_bytes=2**20,
                      piece_bytes=MIN_PIECE_BYTES) as sender:
        assert sender.sync(models[1], version=1) == 1
    assert all(outputs(e) == expected for e in engines)
    assert all(len(handed[i]) == len(e.model.named_tensors()) for i, e in enumerate(engines))
    for i, e in enumerate(engines):  # the live weights are the very buffers the transport wrote
        live, h = e.model.named_tensors(), handed[i]
        assert all(live[n].data_ptr() == t.data_ptr() for n, t in h.items())


def test_a_replica_keeps_its_mapping_while_the_sender_keeps_the_segment(engines, models):
    engines, receivers = engines
    with WeightSender([LocalControl(r) for r in receivers], Transport.SHM, timeout_s=3.0, bucket_bytes=2**20,
                      piece_bytes=MIN_PIECE_BYTES) as sender:
        sender.sync(models[1], version=1)
        name = sender.regions.region.name
        assert [r.mappings.mapped for r in receivers] == [name, name]
        sender.sync(models[0], version=2)  # the same segment, the same mappings
        assert [r.mappings.mapped for r in receivers] == [name, name]
    for r in receivers:  # the sender unlinked it: each mapping goes within its check period
        r.mappings._check()
    assert [r.mappings.mapped for r in receivers] == [None, None]
    assert all(outputs(e) == outputs(engine_of(models[0])) for e in engines)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_pipeline_delivers_every_piece_whole_to_every_replica(replicas):
    """Pieces of any size, down to one byte, reach every replica whole and in order."""
    sizes = [1, 2, 3, 7, 8, 1000, 4097, 70_001]
    rng = np.random.default_rng(replicas)
    sent = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]
    group = WeightGroup.host(world_size=1 + replicas, timeout_s=10.0)
    received, joined = {}, []

    def replica(rank):
        member = WeightGroup.join("127.0.0.1", group.port, world_size=1 + replicas, rank=rank, timeout_s=10.0)
        joined.append(member)
        got = []
        member.pipeline((torch.zeros(n, dtype=torch.uint8) for n in sizes), lambda k, piece: got.append(piece))
        received[rank] = got

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(1, 1 + replicas)]
    for t in threads:
        t.start()
    group.connect()
    try:
        group.pipeline(iter(sent))
        for t in threads:
            t.join(timeout=20)
        assert sorted(received) == list(range(1, 1 + replicas))
        assert all(torch.equal(a, b) for got in received.values() for a, b in zip(got, sent, strict=True))
    finally:
        for member in [group, *joined]:
            member.close()
