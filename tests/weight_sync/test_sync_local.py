"""Sender and receivers in one process (receivers are in-process engines; gloo groups across
threads): every transport ends equal to a fresh engine of the new weights, sequences of calls are
one update, and every failure leaves the old weights serving (double) or nothing serving
(in place) until a complete update."""

from __future__ import annotations

import threading
import time
import typing

import pytest
import torch

from inference import EngineStateError, Staging
from tests.weight_sync.local import LocalControl, corrupting_pipeline, engine_of, outputs, tiny_llama
from weight_sync import (
    DiskSource,
    DistributedSource,
    SyncError,
    Transport,
    WeightReceiver,
    WeightSender,
    WeightSource,
    hf_to_megatron,
    memcopy,
)
from weight_sync.buckets import manifest_for
from weight_sync.transports import disk, distributed
from weight_sync.transports.bucket_broadcast import send_tensors
from weight_sync.transports.distributed import WeightGroup
from weight_sync.transports.table import BY_SOURCE, BY_TRANSPORT

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def old():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def new():
    return tiny_llama(seed=1)


@pytest.fixture(scope="module")
def expected(old, new):
    return outputs(engine_of(old)), outputs(engine_of(new))


@pytest.fixture
def replicas(old):
    """Two engines of the old weights, each behind a receiver (closed after the test)."""
    engines = [engine_of(old), engine_of(old)]
    receivers = [WeightReceiver(e, timeout_s=TIMEOUT_S) for e in engines]
    yield engines, receivers
    for r in receivers:
        r.close()


def sender_for(receivers, transport, tmp_path, **kwargs) -> WeightSender:
    extra = {"directory": tmp_path} if transport is Transport.DISK else {}
    return WeightSender([LocalControl(r) for r in receivers], transport, timeout_s=TIMEOUT_S, bucket_bytes=16384,
                        **extra, **kwargs)


def test_every_transport_and_every_source_has_its_transport_object():
    assert set(BY_TRANSPORT) == set(Transport)
    assert set(BY_SOURCE) == set(typing.get_args(WeightSource))
    assert all(BY_SOURCE[obj.source_type] is obj for obj in BY_TRANSPORT.values())


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM, Transport.DISK])
def test_every_transport_equals_a_fresh_engine_both_ways(replicas, new, old, expected, transport, tmp_path):
    engines, receivers = replicas
    before, after = expected
    with sender_for(receivers, transport, tmp_path) as sender:
        assert sender.sync(new, version=4) == 4
        assert all(outputs(e) == after and e.policy_version == 4 for e in engines)
        assert sender.sync(old) == 5  # the next version; a double update copies into the spare buffers
        assert all(outputs(e) == before and e.policy_version == 5 for e in engines)
        assert all(e.stats()["weights_spare_bytes"] > 0 for e in engines)
    assert [r.stats.updates_committed for r in receivers] == [2, 2]


def test_the_disk_sender_keeps_its_last_directories_only_when_asked(replicas, new, old, tmp_path):
    receivers = replicas[1]
    with sender_for(receivers, Transport.DISK, tmp_path, keep_last=1) as sender:
        for version, weights in ((1, new), (2, old), (3, new)):
            sender.sync(weights, version=version)
            assert sorted(p.name for p in tmp_path.iterdir()) == [f"v{version:08d}"]  # the older ones are gone
    with sender_for(receivers, Transport.DISK, tmp_path / "all") as sender:
        sender.sync(old, version=4)
        sender.sync(new, version=5)
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["v00000004", "v00000005"]  # checkpoints stay


def test_megatron_names_are_converted_by_the_replica(replicas, new, expected, tmp_path):
    engines, receivers = replicas
    spec = engines[0].model.spec
    megatron = hf_to_megatron({n: p.detach() for n, p in new.named_parameters()}, spec)
    with sender_for(receivers, Transport.GLOO, tmp_path) as sender:
        sender.sync(megatron, version=1)
    assert all(outputs(e) == expected[1] for e in engines)


def test_tensor_by_tensor_calls_are_one_update_committed_by_the_last(replicas, new, expected, tmp_path):
    engines, receivers = replicas
    seen = []
    real = receivers[0].update

    def spy(source, policy=None):
        seen.append((engines[0].policy_version, outputs(engines[0]) == expected[0]))
        return real(source, policy)

    receivers[0].update = spy
    with sender_for(receivers, Transport.GLOO, tmp_path, tensor_by_tensor=True) as sender:
        sender.sync(new, version=2)
    assert len(seen) == len(list(new.named_parameters())) and set(seen) == {(0, True)}  # old weights until the last
    assert all(outputs(e) == expected[1] and e.policy_version == 2 for e in engines)


def _call_each(receivers, source_of):
    """Run one receiver call per receiver on threads; their results or errors."""
    results = [None] * len(receivers)

    def run(i):
        try:
            results[i] = receivers[i].update(source_of(i))
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(receivers))]
    for t in threads:
        t.start()
    return threads, results


def test_an_open_sequence_in_place_refuses_to_serve_and_expires(replicas, new, expected):
    engines, receivers = replicas
    group = WeightGroup.host(world_size=3, timeout_s=TIMEOUT_S)
    joins = [threading.Thread(target=r.init_group, args=("127.0.0.1", group.port, i + 1, 3)) for i, r in
             enumerate(receivers)]
    for t in joins:
        t.start()
    group.connect()
    for t in joins:
        t.join()
    named = [(n, p.detach()) for n, p in new.named_parameters()]
    from weight_sync import DistributedSource

    first = manifest_for(named[:2], packed=False)
    for r in receivers:
        r.timeout_s = 0.5  # NOTE: how long an open update waits for its next call (the group keeps its own)
    threads, results = _call_each(receivers, lambda i: DistributedSource(
        manifest=first, finish=False, staging=Staging.IN_PLACE if i == 0 else Staging.DOUBLE))
    send_tensors(group, [t for _, t in named[:2]])
    for t in threads:
        t.join(TIMEOUT_S)
    assert results == [None, None]  # staged, not committed
    with pytest.raises(EngineStateError, match="in-place"):
        outputs(engines[0])  # open, or (once expired) aborted with mixed weights: refused either way
    assert outputs(engines[1]) == expected[0]
    deadline = time.monotonic() + TIMEOUT_S
    while sum(r.stats.updates_aborted for r in receivers) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r.stats.updates_aborted for r in receivers] == [1, 1]
    assert "waited" in receivers[0].stats.last_error
    with pytest.raises(EngineStateError, match="mixed"):
        outputs(engines[0])  # in place: refused until a complete update
    assert outputs(engines[1]) == expected[0] and engines[1].policy_version == 0
    group.close()


def test_a_corrupted_bucket_aborts_on_every_replica(replicas, new, expected, tmp_path, monkeypatch):
    engines, receivers = replicas
    receivers[1].staging = Staging.IN_PLACE
    corrupt, real = corrupting_pipeline(bucket=1)
    monkeypatch.setattr(distributed.WeightGroup, "pipeline", corrupt)
    with sender_for(receivers, Transport.GLOO, tmp_path) as sender:
        with pytest.raises(SyncError, match="checksum") as info:
            sender.sync(new, version=3)
        assert len(info.value.replies) == 2
        assert outputs(engines[0]) == expected[0] and engines[0].policy_version == 0  # double: old weights
        with pytest.raises(EngineStateError, match="mixed"):
            outputs(engines[1])  # in place, bucket 0 was written: nothing serves
        monkeypatch.setattr(distributed.WeightGroup, "pipeline", real)
        assert sender.sync(new, version=3) == 3  # the group survived (every rank agreed to stop)
    assert all(outputs(e) == expected[1] for e in engines)


def test_a_missing_or_tampered_checkpoint_file_aborts(replicas, new, expected, tmp_path):
    engines, receivers = replicas
    named = [(n, p.detach()) for n, p in new.named_parameters()]
    manifest = disk.write_checkpoint(tmp_path / "v1", named, version=1, bucket_bytes=16384)
    assert manifest.num_buckets > 1
    victim = tmp_path / "v1" / disk.bucket_file(1, manifest.num_buckets)
    data = victim.read_bytes()
    victim.write_bytes(data[:-4] + bytes(b ^ 1 for b in data[-4:]))
    with pytest.raises(ValueError, match="checksum"):
        receivers[0].update(DiskSource(path=str(tmp_path / "v1")))
    victim.unlink()
    with pytest.raises(ValueError, match="missing"):
        receivers[0].update(DiskSource(path=str(tmp_path / "v1")))
    assert outputs(engines[0]) == expected[0] and engines[0].policy_version == 0


def test_the_receivers_copy_out_of_shared_memory(replicas, new, expected, tmp_path):
    engines, receivers = replicas
    with sender_for(receivers, Transport.SHM, tmp_path) as sender:
        sender.sync(new, version=1)
        region = sender.regions.region
        name = region.name
        region.tensor.fill_(0)  # the sender reuses its region: the engines must not see it
        assert all(outputs(e) == expected[1] for e in engines)
        sender.sync(new, version=2)
        assert sender.regions.region.name == name  # reused, not reallocated
    assert not (region.path.exists())  # closed with the sender
    engine_tensors = [t for e in engines for t in e.model.named_tensors().values()]
    assert all(t.untyped_storage().filename is None for t in engine_tensors)


def test_a_busy_receiver_refuses_a_second_update_at_once(replicas):
    _, receivers = replicas
    with receivers[0]._exclusive("test"):
        with pytest.raises(EngineStateError, match="in flight"):
            receivers[0].update(DiskSource(path="/nonexistent"))


def test_bad_calls_are_refused_before_anything_changes(replicas, tmp_path):
    engines, receivers = replicas
    named = [(n, torch.zeros_like(p)) for n, p in tiny_llama(seed=0, hidden=64).named_parameters()]
    disk.write_checkpoint(tmp_path / "other", named, version=1)
    with pytest.raises(ValueError, match="another model"):
        receivers[0].update(DiskSource(path=str(tmp_path / "other")))
    with pytest.raises(ValueError, match="init_weights_update_group first"):
        receivers[0].update(DistributedSource(manifest=manifest_for(named)))
    assert engines[0].policy_version == 0 and receivers[0].stats.updates_committed == 0


def test_a_shared_memory_piece_that_does_not_match_its_checksum_aborts_everywhere(replicas, new, expected,
                                                                                tmp_path, monkeypatch):
    engines, receivers = replicas
    receivers[1].staging = Staging.IN_PLACE
    real = memcopy.publish

    def publish(header, slot, checksum, token):  # the sender's sum disagrees with the bytes it copied
        real(header, slot, checksum ^ 1, token)

    monkeypatch.setattr(memcopy, "publish", publish)
    with sender_for(receivers, Transport.SHM, tmp_path) as sender:
        with pytest.raises(SyncError, match="checksum") as info:
            sender.sync(new, version=3)
        assert all("piece 0" in str(r) for r in info.value.replies)
        assert [r.stats.updates_aborted for r in receivers] == [1, 1]
        # nothing was loaded: the double replica and the in-place one both serve their old weights
        assert all(outputs(e) == expected[0] and e.policy_version == 0 for e in engines)
        monkeypatch.setattr(memcopy, "publish", real)
        assert sender.sync(new, version=3) == 3
    assert all(outputs(e) == expected[1] for e in engines)
