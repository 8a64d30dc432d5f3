"""Delta syncs between real processes on CPU (`rollout serve` replicas, one staging double, one in
place): a delta over gloo or shared memory ends where a fresh engine of the new weights is; a
corrupted piece or a trainer killed mid-delta commits nothing anywhere (the in-place replica too
keeps serving: a delta writes only after its hash matched), and the next sync heals; a replica
moved to another version gets the update in full while the other takes the delta. Every wait is
bounded; the weight-sync timeout is a few seconds."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rollout import RolloutClient, ServerProcess
from tests.rollout.service_util import SERVER_ARGS, save_tiny_model
from tests.weight_sync.local import corrupting_pipeline
from tests.weight_sync.test_sync_processes import ROOT, fresh_outputs, hf_weights, remote_outputs, stat, versions
from weight_sync import SyncError, Transport, WeightSender
from weight_sync.transports import distributed
from weight_sync.transports.shm import remove_stale_segments

TIMEOUT_S = 3.0


def nudged(directory: Path, out: Path, seed: int) -> Path:
    """`directory`'s model with 2% of each tensor's elements changed: what a step of training does."""
    from safetensors.torch import save_file

    shutil.copytree(directory, out)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, t in hf_weights(directory).items():
        mask = torch.rand(t.shape, generator=gen) < 0.02
        weights[name] = torch.where(mask, t * -3.0, t).contiguous()
    for old in out.glob("*.safetensors"):
        old.unlink()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("delta-models")
    base = save_tiny_model(root / "base", seed=1)
    dirs = {"base": base, "step1": nudged(base, root / "step1", 1), "step2": nudged(base, root / "step2", 2)}
    return dirs, {k: fresh_outputs(d) for k, d in dirs.items()}


@pytest.fixture(scope="module")
def replicas(models):
    dirs, _ = models
    args = (*SERVER_ARGS, "--weight-sync-timeout-s", str(TIMEOUT_S))
    in_place = ("--weight-staging", "in_place")
    with ServerProcess(dirs["base"], *args) as a, ServerProcess(dirs["base"], *args, *in_place) as b:
        clients = [RolloutClient(a.address, timeout=30), RolloutClient(b.address, timeout=30)]
        yield (a, b), clients
        for c in clients:
            c.close()


def delta_sender(clients, transport) -> WeightSender:
    return WeightSender(clients, transport, delta=True, timeout_s=TIMEOUT_S, bucket_bytes=32 * 1024,
                        piece_bytes=64 * 1024)


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
def test_a_delta_between_processes_ends_where_a_fresh_engine_of_the_new_weights_is(replicas, models, transport):
    clients, (dirs, expected) = replicas[1], models
    v = max(versions(clients))
    with delta_sender(clients, transport) as sender:
        sender.sync(hf_weights(dirs["base"]), version=v + 1)
        received = [stat(c, "bytes_received") for c in clients]
        assert sender.sync(hf_weights(dirs["step1"]), version=v + 2) == v + 2 and sender.stats.last_delta
        moved = [stat(c, "bytes_received") - r for c, r in zip(clients, received)]
        full = sum(t.numel() * t.element_size() for t in hf_weights(dirs["step1"]).values())
        assert all(0 < m < full / 2 for m in moved)  # the delta's payload, not the model
    assert versions(clients) == [v + 2] * 2
    assert [remote_outputs(c) for c in clients] == [expected["step1"]] * 2


def test_a_corrupted_delta_piece_commits_nowhere_and_the_next_sync_heals(replicas, models, monkeypatch):
    clients, (dirs, expected) = replicas[1], models
    v = max(versions(clients))
    with delta_sender(clients, Transport.GLOO) as sender:
        sender.sync(hf_weights(dirs["base"]), version=v + 1)
        corrupt, real = corrupting_pipeline(bucket=0)  # one bit of the payload, after its checksum went out
        monkeypatch.setattr(distributed.WeightGroup, "pipeline", corrupt)
        with pytest.raises(SyncError, match="checksum"):
            sender.sync(hf_weights(dirs["step1"]), version=v + 2)
        monkeypatch.setattr(distributed.WeightGroup, "pipeline", real)
        assert versions(clients) == [v + 1] * 2
        assert [remote_outputs(c) for c in clients] == [expected["base"]] * 2  # in place too: nothing written
        assert sender.sync(hf_weights(dirs["step1"]), version=v + 2) == v + 2 and not sender.stats.last_delta
    assert [remote_outputs(c) for c in clients] == [expected["step1"]] * 2


def test_a_replica_moved_to_another_version_gets_the_update_in_full_while_the_other_takes_the_delta(
        replicas, models, tmp_path):
    clients, (dirs, expected) = replicas[1], models
    v = max(versions(clients))
    with delta_sender(clients, Transport.SHM) as sender:
        sender.sync(hf_weights(dirs["base"]), version=v + 1)
        with WeightSender(clients[1:], Transport.DISK, directory=tmp_path, timeout_s=TIMEOUT_S) as other:
            other.sync(hf_weights(dirs["step2"]), version=v + 2)  # another trainer moved replica B on
        aborted = [stat(c, "updates_aborted") for c in clients]
        assert sender.sync(hf_weights(dirs["step1"]), version=v + 3) == v + 3
        # B's version said so before a byte moved: no refusal; B read the payload's full section, A its delta
        assert sender.stats.last_delta and sender.stats.last_full_replicas == 1
        assert [stat(c, "updates_aborted") for c in clients] == aborted
        assert [remote_outputs(c) for c in clients] == [expected["step1"]] * 2
        assert sender.sync(hf_weights(dirs["step2"]), version=v + 4) == v + 4 and sender.stats.last_delta
    assert [remote_outputs(c) for c in clients] == [expected["step2"]] * 2


@pytest.mark.parametrize("transport,how,says", [
    ("gloo", ("--die-in-bucket", "0"), "killed while bucket 0 is on the wire"),
    ("shm", ("--die-in-piece", "0"), "piece 0 of its segment filled"),
])
def test_a_trainer_killed_mid_delta_leaves_every_replica_serving_its_base_and_the_next_sync_heals(
        replicas, models, transport, how, says):
    (procs, clients), (dirs, expected) = replicas, models
    v = max(versions(clients))
    aborted = [stat(c, "updates_aborted") for c in clients]
    trainer = subprocess.run(
        [sys.executable, "-m", "tests.weight_sync.trainer_proc", str(dirs["step1"]), str(v + 2),
         *(p.address for p in procs), "--delta-from", str(dirs["base"]), "--transport", transport, *how,
         "--timeout-s", str(TIMEOUT_S)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    died = time.monotonic()
    assert trainer.returncode == -9 and f"base version {v + 1}" in trainer.stdout and says in trainer.stdout, \
        trainer.stderr
    while [stat(c, "updates_aborted") for c in clients] != [a + 1 for a in aborted]:
        assert time.monotonic() - died < TIMEOUT_S + 5.0, \
            ("a replica waited past its timeout", [stat(c, "last_error") for c in clients])
        time.sleep(0.05)
    assert versions(clients) == [v + 1] * 2
    assert [remote_outputs(c) for c in clients] == [expected["base"]] * 2  # both whole: nothing was half-applied
    remove_stale_segments()  # what a killed shm sender left in /dev/shm
    with delta_sender(clients, Transport(transport)) as sender:  # a new trainer: no base, so a full sync
        assert sender.sync(hf_weights(dirs["step1"]), version=v + 2) == v + 2 and not sender.stats.last_delta
    assert [remote_outputs(c) for c in clients] == [expected["step1"]] * 2


def router_sees(client: RolloutClient, versions: list[int]) -> None:
    """Wait (bounded) until the router's stats, its view of each replica (refreshed by its own
    health checks), show these versions: what the sender reads before a delta."""
    deadline = time.monotonic() + 10.0
    while True:
        stats = client.stats()
        seen = sorted(int(v) for k, v in stats.items() if k.startswith("replica/") and k.endswith("/policy_version"))
        if seen == versions:
            return
        assert time.monotonic() < deadline, f"the router sees versions {seen}, not {versions}"
        time.sleep(0.1)


def router_waits(client: RolloutClient, key: str, want: int) -> None:
    """Wait (bounded) until the router's stat `key` is `want` (its health checks move it)."""
    deadline = time.monotonic() + 10.0
    while (seen := int(client.stats()[key])) != want:
        assert time.monotonic() < deadline, f"the router's {key} is {seen}, not {want}"
        time.sleep(0.1)


@pytest.mark.parametrize("transport", [Transport.SHM, Transport.GLOO])
def test_behind_a_router_a_replica_moved_to_another_version_reads_the_full_manifest(replicas, models, tmp_path,
                                                                                     transport):
    """The sender reads each replica's version from the router's stats; the replica that another
    trainer moved on takes the same source's full manifest (a pure delta it would have refused).
    The router follows the moved one (the newer version) and takes the other out as lagging, with
    no update to replay; the trainer's next sync still reaches it (a weight group's broadcast goes
    to lagging replicas too: over gloo the group would not even form without it), so both end on
    the new version and the router takes the lagging one back."""
    from rollout.router.process import RouterProcess

    (procs, clients), (dirs, expected) = replicas, models
    v = max(versions(clients))
    addresses = ",".join(p.address for p in procs)  # NOTE: the module's replicas, behind a router of this test's
    with RouterProcess("--replicas", addresses, ready_timeout=60) as router, \
            RolloutClient(router.address, timeout=30) as client:
        with WeightSender([client], transport, replicas=2, delta=True, timeout_s=TIMEOUT_S,
                          bucket_bytes=32 * 1024, piece_bytes=64 * 1024) as sender:
            sender.sync(hf_weights(dirs["base"]), version=v + 1)
            router_sees(client, [v + 1, v + 1])
            moved = sorted(v for k, v in client.stats().items() if k.startswith("replica/") and
                           k.endswith("/address"))[1]
            with RolloutClient(moved, timeout=30) as b, \
                    WeightSender([b], Transport.DISK, directory=tmp_path, timeout_s=TIMEOUT_S) as other:
                other.sync(hf_weights(dirs["step2"]), version=v + 2)  # another trainer moved one replica on
            router_sees(client, [v + 1, v + 2])
            router_waits(client, "replicas_up", 1)  # the one left at v + 1 is out: nothing routed to it
            router_waits(client, "replicas_weight_group", 2)  # ... but it is in the weight group
            assert sender.sync(hf_weights(dirs["step1"]), version=v + 3) == v + 3
            assert sender.stats.last_delta and sender.stats.last_full_replicas == 1  # the moved one: in full
            router_waits(client, "replicas_up", 2)  # both on v + 3: the lagging one is back
        for c in clients:
            assert int(c.get_weight_version()) == v + 3 and remote_outputs(c) == expected["step1"]
