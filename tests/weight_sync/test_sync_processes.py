"""Weight sync between real processes on CPU (gloo): one trainer, two replicas (`rollout serve`).

Replica A stages updates double (its old weights serve until the commit), replica B in place. The
trainer is this process, or (to be killed mid-transfer) a process of its own. Every wait is
bounded; the weight-sync timeout is a few seconds.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from inference import DynamicInferenceEngine
from rollout import RolloutClient, ServerProcess
from rollout.wire.codec import ProtocolError
from rollout.wire.kinds import ErrorCode
from tests.rollout.service_util import SERVER_ARGS, VOCAB, engine_config, greedy, random_prompts, save_tiny_model
from tests.weight_sync.local import corrupting_pipeline
from weight_sync import SyncError, Transport, WeightSender
from weight_sync.transports import distributed
from weight_sync.transports.shm import remove_stale_segments

TIMEOUT_S = 3.0
PROMPTS = random_prompts(4, 3, 9, seed=5)
ROOT = Path(__file__).resolve().parents[2]


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    from inference.models.loading import read_safetensors

    return read_safetensors(directory, None)


def fresh_outputs(directory: Path) -> list[list[int]]:
    engine = DynamicInferenceEngine.from_pretrained(directory, engine_config())
    return [o.generated_token_ids for o in engine.generate(PROMPTS, greedy(6))]


def remote_outputs(client: RolloutClient) -> list[list[int]]:
    return [r.completion_ids for r in client.generate(PROMPTS, sampling=greedy(6), timeout=30)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dirs = {seed: save_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1, 2)}
    return dirs, {seed: fresh_outputs(d) for seed, d in dirs.items()}


@pytest.fixture(scope="module")
def replicas(models):
    dirs, _ = models
    args = (*SERVER_ARGS, "--weight-sync-timeout-s", str(TIMEOUT_S))
    with ServerProcess(dirs[0], *args) as a, ServerProcess(dirs[0], *args, "--weight-staging", "in_place") as b:
        clients = [RolloutClient(a.address, timeout=30), RolloutClient(b.address, timeout=30)]
        yield (a, b), clients
        for c in clients:
            c.close()


def sync(clients, weights, version, transport=Transport.GLOO, **kwargs) -> int:
    with WeightSender(clients, transport, timeout_s=TIMEOUT_S, bucket_bytes=32 * 1024, **kwargs) as sender:
        return sender.sync(weights, version=version)


def versions(clients) -> list[int]:
    return [int(c.get_weight_version()) for c in clients]


def stat(client: RolloutClient, name: str):
    return client.stats()[f"weight_sync/{name}"]


def test_after_a_sync_both_replicas_equal_a_fresh_engine_of_the_trainers_weights(replicas, models, tmp_path):
    (procs, clients), (dirs, expected) = replicas, models
    base = max(versions(clients))
    for step, (transport, seed) in enumerate([(Transport.GLOO, 1), (Transport.SHM, 2), (Transport.DISK, 1)], start=1):
        extra = {"directory": tmp_path} if transport is Transport.DISK else {}
        assert sync(clients, hf_weights(dirs[seed]), base + step, transport, **extra) == base + step
        assert versions(clients) == [base + step] * 2
        assert [remote_outputs(c) for c in clients] == [expected[seed]] * 2, transport
        if transport is Transport.SHM:  # the sender unlinked its segment: within a second or two no replica maps it
            deadline = time.monotonic() + 5.0
            while any("rollout-wsync-" in Path(f"/proc/{p.pid}/maps").read_text() for p in procs):
                assert time.monotonic() < deadline, "a replica kept the segment of a sender that closed it"
                time.sleep(0.1)


def test_a_manifest_for_another_model_is_rejected_before_any_byte_moves(replicas, models):
    clients, (dirs, expected) = replicas[1], models
    sync(clients, hf_weights(dirs[1]), max(versions(clients)) + 1)
    before_v, before_bytes = versions(clients), [stat(c, "bytes_received") for c in clients]
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with WeightSender(clients, Transport.GLOO, timeout_s=TIMEOUT_S) as sender:
        with pytest.raises(SyncError, match="another model") as info:
            sender.sync(other, version=before_v[0] + 1)
        assert sender.stats.bytes_sent == 0 and sender.group is not None and sender.group.broken is None
        assert all("another model" in str(r) for r in info.value.replies)  # each replica said why
    assert [stat(c, "bytes_received") for c in clients] == before_bytes
    assert versions(clients) == before_v and [remote_outputs(c) for c in clients] == [expected[1]] * 2


def test_a_corrupted_bucket_aborts_the_update_on_both_replicas(replicas, models, monkeypatch):
    clients, (dirs, expected) = replicas[1], models
    v = max(versions(clients))
    sync(clients, hf_weights(dirs[1]), v + 1)
    corrupt, real = corrupting_pipeline(bucket=1)  # one bit, after the checksum was taken
    monkeypatch.setattr(distributed.WeightGroup, "pipeline", corrupt)
    with pytest.raises(SyncError, match="checksum"):
        sync(clients, hf_weights(dirs[2]), v + 2)
    assert versions(clients) == [v + 1] * 2
    assert remote_outputs(clients[0]) == expected[1]  # double: the old weights serve
    with pytest.raises(ProtocolError, match="mixed") as info:
        remote_outputs(clients[1])  # in place: bucket 0 was written, so nothing serves until a complete update
    assert info.value.code is ErrorCode.NO_WEIGHTS  # only a complete update ends it: not a retry for later
    monkeypatch.setattr(distributed.WeightGroup, "pipeline", real)
    sync(clients, hf_weights(dirs[2]), v + 2)
    assert [remote_outputs(c) for c in clients] == [expected[2]] * 2


def kill_a_trainer_mid_update(procs, clients, dirs, says: str, *how: str):
    """Sync seed 1, then run a trainer process that syncs seed 2 and kills itself midway (`how`);
    (the version before, each replica's aborted count before, when the trainer died)."""
    v = max(versions(clients))
    sync(clients, hf_weights(dirs[1]), v + 1)
    aborted = [stat(c, "updates_aborted") for c in clients]
    trainer = subprocess.run(
        [sys.executable, "-m", "tests.weight_sync.trainer_proc", str(dirs[2]), str(v + 2), *(p.address for p in procs),
         *how, "--timeout-s", str(TIMEOUT_S)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    died = time.monotonic()
    assert trainer.returncode == -9 and says in trainer.stdout, trainer.stderr
    return v, aborted, died


def test_a_sender_killed_mid_bucket_leaves_no_replica_on_mixed_weights_nor_blocked(replicas, models):
    (procs, clients), (dirs, expected) = replicas, models
    v, aborted, died = kill_a_trainer_mid_update(procs, clients, dirs, "killed while bucket 2 is on the wire",
                                                 "--die-in-bucket", "2")
    health = [c.health(timeout=2.0) for c in clients]  # answered at once meanwhile: no lane is stuck
    assert all(h.healthy for h in health)
    while [stat(c, "updates_aborted") for c in clients] == aborted:
        assert time.monotonic() - died < TIMEOUT_S + 5.0, "a replica waited past its timeout"
        time.sleep(0.1)
    deadline = time.monotonic() + 5.0
    while [stat(c, "updates_aborted") for c in clients] != [a + 1 for a in aborted]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert all("broadcast" in stat(c, "last_error") for c in clients)
    assert versions(clients) == [v + 1] * 2
    assert remote_outputs(clients[0]) == expected[1]  # double: its old weights, whole
    with pytest.raises(ProtocolError, match="mixed"):
        remote_outputs(clients[1])  # in place: refuses, with a clear error, until a complete update
    assert sync(clients, hf_weights(dirs[2]), v + 2) == v + 2  # a new trainer regroups and heals both
    assert [remote_outputs(c) for c in clients] == [expected[2]] * 2


def test_a_shared_memory_sender_killed_mid_segment_is_noticed_without_waiting_out_the_timeout(replicas, models):
    (procs, clients), (dirs, expected) = replicas, models
    v, aborted, died = kill_a_trainer_mid_update(procs, clients, dirs, "piece 1 of its segment filled",
                                                 "--transport", "shm", "--die-in-piece", "1")
    while [stat(c, "updates_aborted") for c in clients] != [a + 1 for a in aborted]:
        assert time.monotonic() - died < TIMEOUT_S + 5.0, "a replica waited past its timeout"
        time.sleep(0.05)
    assert all("exited before publishing piece 1" in stat(c, "last_error") for c in clients)  # not the timeout
    assert versions(clients) == [v + 1] * 2
    assert remote_outputs(clients[0]) == expected[1]  # double: its old weights, whole
    with pytest.raises(ProtocolError, match="mixed"):
        remote_outputs(clients[1])  # in place: piece 0's buckets were written, so nothing serves
    remove_stale_segments()  # what the killed sender left in /dev/shm
    assert sync(clients, hf_weights(dirs[2]), v + 2, "shm") == v + 2
    assert [remote_outputs(c) for c in clients] == [expected[2]] * 2
