"""Weight sync into GPU replicas (`rollout serve --device cuda`): CUDA IPC handles, gloo into a GPU
engine, and an NCCL broadcast between two GPUs. Skipped without CUDA (NCCL also needs a second GPU:
it refuses two ranks of one group on one device). `scripts/gpu_weight_sync.sh` runs these and
prints CUDA IPC / NCCL figures; see docs/weight-sync.md.

Each sync must leave the replica equal (greedy) to a fresh engine of the new weights on the same
device, and a corrupted bucket must abort with the old weights still serving (double staging).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference import DynamicInferenceEngine
from rollout import RolloutClient, ServerProcess
from tests.rollout.service_util import SERVER_ARGS, engine_config, greedy, random_prompts, save_tiny_model
from weight_sync import SyncError, Transport, WeightSender

pytestmark = pytest.mark.gpu

TIMEOUT_S = 30.0
PROMPTS = random_prompts(4, 3, 9, seed=5)


def weights_of(directory, device: str) -> dict[str, torch.Tensor]:
    from inference.models.loading import read_safetensors

    return {n: t.to(device) for n, t in read_safetensors(directory, None).items()}


def fresh_outputs(directory, device: str) -> list[list[int]]:
    engine = DynamicInferenceEngine.from_pretrained(directory, dataclasses.replace(engine_config(), device=device))
    return [o.generated_token_ids for o in engine.generate(PROMPTS, greedy(6))]


def remote_outputs(client: RolloutClient) -> list[list[int]]:
    return [r.completion_ids for r in client.generate(PROMPTS, sampling=greedy(6), timeout=60)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-models")
    return {seed: save_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1, 2)}


def replica(directory, device: str) -> ServerProcess:
    return ServerProcess(directory, *SERVER_ARGS, "--device", device, "--weight-sync-timeout-s", str(TIMEOUT_S),
                         ready_timeout=300)


def test_cuda_ipc_buckets_reach_a_gpu_replica_and_a_corrupted_one_aborts(models, monkeypatch):
    import weight_sync.sender as sender_module

    expected = {seed: fresh_outputs(models[seed], "cuda") for seed in (1, 2)}
    with replica(models[0], "cuda") as proc, RolloutClient(proc.address, timeout=60) as client:
        # small buckets: several IPC handles, most of them at an offset inside the allocator's block
        with WeightSender([client], Transport.SHM, timeout_s=TIMEOUT_S, bucket_bytes=64 * 1024) as sender:
            assert sender.sync(weights_of(models[1], "cuda"), version=1) == 1
            assert remote_outputs(client) == expected[1]
            real = sender_module.pack_bucket

            def corrupt(manifest, index, tensors, out):
                checksum = real(manifest, index, tensors, out)
                if index == 1:
                    out[5] ^= 0x10  # after the checksum was taken
                return checksum

            monkeypatch.setattr(sender_module, "pack_bucket", corrupt)
            with pytest.raises(SyncError, match="checksum"):
                sender.sync(weights_of(models[2], "cuda"), version=2)
            assert client.get_weight_version() == "1" and remote_outputs(client) == expected[1]
            monkeypatch.setattr(sender_module, "pack_bucket", real)
            assert sender.sync(weights_of(models[2], "cuda"), version=2) == 2
        assert remote_outputs(client) == expected[2]


def test_gloo_from_a_cpu_trainer_into_a_gpu_replica(models):
    expected = fresh_outputs(models[1], "cuda")
    with replica(models[0], "cuda") as proc, RolloutClient(proc.address, timeout=60) as client:
        with WeightSender([client], Transport.GLOO, timeout_s=TIMEOUT_S, bucket_bytes=64 * 1024) as sender:
            assert sender.sync(weights_of(models[1], "cpu"), version=1) == 1
        assert remote_outputs(client) == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per device)")
def test_nccl_broadcast_from_a_trainer_gpu_into_a_replica_on_another_gpu(models):
    expected = fresh_outputs(models[1], "cuda:1")
    with replica(models[0], "cuda:1") as proc, RolloutClient(proc.address, timeout=60) as client:
        with WeightSender([client], Transport.NCCL, timeout_s=TIMEOUT_S, bucket_bytes=64 * 1024) as sender:
            assert sender.sync(weights_of(models[1], "cuda:0"), version=1) == 1
            assert sender.group is not None and sender.group.backend == "nccl"
        assert remote_outputs(client) == expected
