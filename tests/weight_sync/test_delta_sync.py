"""Delta syncs between a trainer and in-process replicas (gloo groups across threads, shared
memory): after many AdamW steps at lr 1e-6 (fp32 master weights, bf16 replicas) every replica is
bitwise the trainer's bf16 cast and generates what a fresh engine does; a replica on another base
gets the update in full out of the same payload while the rest of its group takes the delta; a
delta that cannot reproduce the trainer's hash, or whose piece was corrupted, aborts with nothing
applied (in place too), and the next sync heals."""

from __future__ import annotations

import copy

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, Staging
from tests.weight_sync.local import GREEDY, PROMPTS, LocalControl, corrupting_pipeline, tiny_llama
from weight_sync import SyncError, Transport, WeightReceiver, WeightSender, memcopy
from weight_sync.transports import distributed

TIMEOUT_S = 5.0
LR = 1e-6  # a realistic RL learning rate: about 1% of bf16 words change per step
IDS = torch.tensor([[1, 5, 9, 13, 2, 7, 7, 3]])


def bf16_engine(model) -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_pretrained(model, InferenceConfig(
        block_size=4, num_blocks=64, max_requests=8, max_batch_tokens=64, max_sequence_length=64,
        dtype=torch.bfloat16))


def greedy(engine) -> list[list[int]]:
    return [o.generated_token_ids for o in engine.generate(PROMPTS, GREEDY)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16)


def assert_bitwise(engine, trainer) -> None:
    live = engine.model.named_tensors()
    for name, p in trainer.named_parameters():
        assert torch.equal(bits(live[name]), bits(p.to(torch.bfloat16))), f"{name} is not the trainer's bf16 cast"


class Trainer:
    """fp32 master weights and their AdamW, one real (tiny) LM loss step at a time."""

    def __init__(self, seed: int = 0) -> None:
        self.model = tiny_llama(seed).float().train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self) -> None:
        loss = self.model(IDS, labels=IDS).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


@pytest.fixture
def replicas():
    """Two bf16 engines of other weights (seed 1), one staging double, one in place."""
    engines = [bf16_engine(tiny_llama(1)), bf16_engine(tiny_llama(1))]
    receivers = [WeightReceiver(engines[0], timeout_s=TIMEOUT_S),
                 WeightReceiver(engines[1], timeout_s=TIMEOUT_S, staging=Staging.IN_PLACE)]
    yield engines, receivers
    for r in receivers:
        r.close()


def delta_sender(receivers, transport) -> WeightSender:
    return WeightSender([LocalControl(r) for r in receivers], transport, delta=True, dtype=torch.bfloat16,
                        timeout_s=TIMEOUT_S, bucket_bytes=16384, piece_bytes=64 * 1024)


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
def test_after_100_delta_syncs_the_replicas_are_bitwise_the_trainers_bf16_cast(replicas, transport):
    engines, receivers = replicas
    trainer = Trainer()
    full_bytes = sum(p.numel() * 2 for p in trainer.model.parameters())
    with delta_sender(receivers, transport) as sender:
        sender.sync(trainer.model)  # the first sync is full: there is no base yet
        assert not sender.stats.last_delta and sender.stats.last_bytes >= full_bytes
        payloads = []
        for _ in range(100):
            trainer.step()
            sender.sync(trainer.model)
            assert sender.stats.last_delta
            payloads.append(sender.stats.last_bytes)
        assert sender.stats.delta_syncs == 100 and sender.version == engines[0].policy_version == 101
    assert max(payloads) < full_bytes / 4  # ~1% of the words change per step
    fresh = bf16_engine(copy.deepcopy(trainer.model).eval())
    for engine in engines:
        assert engine.policy_version == 101
        assert_bitwise(engine, trainer.model)
        assert greedy(engine) == greedy(fresh)
    assert [r.stats.updates_aborted for r in receivers] == [0, 0]


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
def test_in_one_group_a_replica_on_another_base_gets_the_update_in_full_while_the_other_takes_the_delta(
        replicas, transport):
    engines, receivers = replicas
    trainer = Trainer()
    full_bytes = sum(p.numel() * 2 for p in trainer.model.parameters())
    with delta_sender(receivers, transport) as sender:
        sender.sync(trainer.model)
        trainer.step()
        sender.sync(trainer.model)
        assert sender.stats.last_delta and sender.stats.last_full_replicas == 0
        delta_bytes = sender.stats.last_bytes
        engines[1].update_weights(dict(tiny_llama(2).named_parameters()), version=7)  # someone else moved it on
        trainer.step()
        assert sender.sync(trainer.model, version=8) == 8
        # the versions were asked first: replica 1 reads the same payload's full section, replica 0 its delta
        assert sender.stats.last_delta and sender.stats.last_full_replicas == 1
        assert sender.stats.last_bytes >= full_bytes + delta_bytes / 4
        for engine in engines:
            assert_bitwise(engine, trainer.model)
        trainer.step()
        sender.sync(trainer.model)
        assert sender.stats.last_full_replicas == 0 and sender.stats.last_bytes < full_bytes / 4  # both on the base
    for engine in engines:
        assert_bitwise(engine, trainer.model)
    assert [r.stats.updates_aborted for r in receivers] == [0, 0]
    assert [r.stats.updates_committed for r in receivers] == [4, 4]


def diverge(engine) -> None:
    """The replica's weights change behind the sender's back, its version unchanged (a
    replica restarted from other weights under the same number): only the hash can tell."""
    with torch.no_grad():
        bits(engine.model.named_tensors()["model.norm.weight"])[0] ^= 1


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
def test_a_delta_onto_weights_that_are_not_its_base_never_commits_and_the_next_sync_heals(replicas, transport):
    engines, receivers = replicas
    trainer = Trainer()
    with delta_sender(receivers, transport) as sender:
        sender.sync(trainer.model)
        diverge(engines[1])  # the in-place replica
        served = greedy(engines[1])
        trainer.step()
        with pytest.raises(SyncError, match="hash"):
            sender.sync(trainer.model)
        assert engines[1].policy_version == 1 and receivers[1].stats.updates_aborted == 1
        assert greedy(engines[1]) == served  # in place too: nothing was written before the hash matched
        if transport is Transport.GLOO:  # one group agrees: nobody commits
            assert engines[0].policy_version == 1
        trainer.step()
        sender.sync(trainer.model)
        assert not sender.stats.last_delta  # the failed sync dropped the base
    for engine in engines:
        assert_bitwise(engine, trainer.model)


def test_a_corrupted_delta_piece_over_gloo_aborts_everywhere_and_the_next_sync_heals(replicas, monkeypatch):
    engines, receivers = replicas
    trainer = Trainer()
    with delta_sender(receivers, Transport.GLOO) as sender:
        sender.sync(trainer.model)
        before = [greedy(e) for e in engines]
        corrupt, real = corrupting_pipeline(bucket=0)  # the delta's payload is one bucket
        monkeypatch.setattr(distributed.WeightGroup, "pipeline", corrupt)
        trainer.step()
        with pytest.raises(SyncError, match="checksum"):
            sender.sync(trainer.model)
        monkeypatch.setattr(distributed.WeightGroup, "pipeline", real)
        assert [e.policy_version for e in engines] == [1, 1] and [greedy(e) for e in engines] == before
        assert [r.stats.updates_aborted for r in receivers] == [1, 1]
        trainer.step()
        sender.sync(trainer.model)
    for engine in engines:
        assert_bitwise(engine, trainer.model)


def test_a_corrupted_delta_piece_in_shared_memory_aborts_everywhere_and_the_next_sync_heals(replicas, monkeypatch):
    engines, receivers = replicas
    trainer = Trainer()
    real = memcopy.publish
    with delta_sender(receivers, Transport.SHM) as sender:
        sender.sync(trainer.model)
        before = [greedy(e) for e in engines]
        monkeypatch.setattr(memcopy, "publish", lambda header, slot, checksum, token: real(header, slot, checksum ^ 1,
                                                                                           token))
        trainer.step()
        with pytest.raises(SyncError, match="checksum"):
            sender.sync(trainer.model)
        monkeypatch.setattr(memcopy, "publish", real)
        assert [e.policy_version for e in engines] == [1, 1] and [greedy(e) for e in engines] == before
        trainer.step()
        sender.sync(trainer.model)
    for engine in engines:
        assert_bitwise(engine, trainer.model)


def test_delta_mode_is_refused_where_it_cannot_ride(replicas, tmp_path):
    receivers = replicas[1]
    for transport, extra in ((Transport.DISK, {"directory": tmp_path}), (Transport.GLOO, {"tensor_by_tensor": True})):
        with pytest.raises(ValueError, match="delta"):
            WeightSender([LocalControl(r) for r in receivers], transport, delta=True, **extra)
