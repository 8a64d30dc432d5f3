"""vLLM's packed broadcast layout (`weight_sync.vllm_layout`) against what vLLM's own packing code
broadcast (`tests/fixtures/vllm_packing`, made by running vLLM's `packed_tensor.py`), byte for
byte; then both ends over a real gloo group on loopback."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from weight_sync import Manifest, WeightGroup
from weight_sync.manifest import DTYPES
from weight_sync.transports.vllm_broadcast import receive, send
from weight_sync.vllm_layout import pack_chunks, plan_chunks, unpack_chunk, update_info

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_packing" / "packed_broadcasts.json").read_text())
CASES = {case["name"]: case for case in FIXTURE["cases"]}


def fixture_tensors(case: dict) -> list[tuple[str, torch.Tensor]]:
    out = []
    for t in case["tensors"]:
        raw = torch.frombuffer(bytearray.fromhex(t["hex"]), dtype=torch.uint8)
        out.append((t["name"], raw.view(DTYPES[t["dtype"]]).view(t["shape"])))
    return out


def manifest_of(named: list[tuple[str, torch.Tensor]]) -> Manifest:
    info = update_info(named)
    return Manifest(names=info["names"], dtypes=info["dtype_names"], shapes=info["shapes"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_our_packing_is_vllm_packing_byte_for_byte(name):
    case = CASES[name]
    named = fixture_tensors(case)
    ours = [bytes(c.numpy().tobytes()) for c in pack_chunks([t for _, t in named], case["buffer_size_bytes"])]
    assert ours == [bytes.fromhex(b) for b in case["broadcasts"]]
    chunks = plan_chunks(manifest_of(named).tensor_bytes(), case["buffer_size_bytes"])
    if case["consumer_error"] is None:  # vLLM's consumer cut the same chunks from the metadata alone
        assert [[named[i][0] for i in c] for c in chunks] == case["consumer_chunks"]
        assert [sum(manifest_of(named).tensor_bytes()[i] for i in c) for c in chunks] == case["consumer_buffer_sizes"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_fixture_unpacks_to_its_tensors_odd_offsets_too(name):
    case = CASES[name]
    named = fixture_tensors(case)
    manifest = manifest_of(named)
    chunks = plan_chunks(manifest.tensor_bytes(), case["buffer_size_bytes"])
    got = {}
    for data, indices in zip([bytes.fromhex(b) for b in case["broadcasts"]], chunks, strict=True):
        got.update(unpack_chunk(torch.frombuffer(bytearray(data), dtype=torch.uint8), manifest, indices))
    assert list(got) == [n for n, _ in named]
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in named)


def test_the_fixture_came_from_vllms_repository():
    assert FIXTURE["source"]["repo"] == "vllm-project/vllm"
    assert FIXTURE["source"]["path"] == "vllm/distributed/weight_transfer/packed_tensor.py"
    assert any(c["consumer_error"] for c in FIXTURE["cases"])  # vLLM's consumer refuses odd offsets; we do not


@given(st.lists(st.integers(0, 300), max_size=30), st.integers(1, 400))
def test_chunks_partition_the_tensors_and_close_past_the_buffer(sizes, buffer_bytes):
    chunks = plan_chunks(sizes, buffer_bytes)
    assert [i for c in chunks for i in c] == list(range(len(sizes)))
    for c in chunks[:-1]:
        assert sum(sizes[i] for i in c) > buffer_bytes  # closed by the tensor that crossed the line
    for c in chunks:
        assert sum(sizes[i] for i in c[:-1]) <= buffer_bytes


@pytest.mark.parametrize("packed,buffer_bytes,num_buffers,workers", [(True, 48, 2, 1), (True, 100, 3, 2),
                                                                    (False, 1, 1, 1)])
def test_both_ends_over_gloo_on_loopback(packed, buffer_bytes, num_buffers, workers):
    """The trainer is rank 0, the workers ranks 1.. (vLLM's rank_offset); every worker gets every tensor."""
    named = fixture_tensors(CASES["odd_64"])
    manifest = manifest_of(named)
    trainer = WeightGroup.host("127.0.0.1", 0, world_size=1 + workers, timeout_s=10.0)
    got: dict[int, dict[str, torch.Tensor]] = {rank: {} for rank in range(1, 1 + workers)}
    members = []

    def worker(rank: int) -> None:
        member = WeightGroup.join("127.0.0.1", trainer.port, world_size=1 + workers, rank=rank, timeout_s=10.0)
        members.append(member)
        receive(member, manifest, buffer_bytes if packed else None,  # NOTE: views of reused buffers: copied
                lambda named: got[rank].update({n: t.clone() for n, t in named.items()}), num_buffers=num_buffers)

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in got]
    for t in threads:
        t.start()
    try:
        trainer.connect()
        sent = send(trainer, [t for _, t in named], packed=packed, buffer_bytes=buffer_bytes, num_buffers=num_buffers)
        for t in threads:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in threads)
        assert sent == sum(manifest.tensor_bytes())
        assert all(torch.equal(got[rank][n], t) for rank in got for n, t in named)
    finally:
        for g in [trainer, *members]:
            g.close()
