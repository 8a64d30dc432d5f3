"""Adapter-only syncs between real processes on CPU: the trainer is this process (a PEFT LoRA on the
tiny Llama the replicas serve), two `rollout serve` replicas sit behind a router (`RolloutRouter`,
on a thread of this process as `rollout route` runs it), and each sync moves the adapter's tensors
alone, over gloo and over shared memory, to both.

What is checked: the bytes moved are the adapter's (each replica counts its own); a request started
before a sync finishes on the version it started with (its tokens are HF + PEFT's at that
version); over 50 syncs at most `max_staleness + 1` versions are resident and the registry's bytes
end where they started; the outputs after the last sync are HF + PEFT's (unmerged), greedy. Every
wait is bounded; the weight-sync timeout is a few seconds.
"""

from __future__ import annotations

import concurrent.futures
import copy

import msgspec
import pytest
import torch
from peft import get_peft_model_state_dict

from inference import PauseMode, SamplingParams
from rollout import RolloutClient, RolloutRouter, RouterConfig, ServerProcess
from rollout.types import TokenChunk
from tests.inference.lora.peft_adapters import greedy_with_logprobs, live_peft, lora_step
from tests.rollout.router.router_util import HEALTH, wait_up
from tests.rollout.service_util import SERVER_ARGS, save_tiny_model, wait_for
from weight_sync import Transport, WeightSender
from weight_sync.buckets import manifest_for

TIMEOUT_S = 3.0
PROMPT = [5, 17, 99, 42, 7, 300, 12, 8, 77]
STEPS = 8
SYNCS = 50
LORA_ARGS = ("--max-loras", "2", "--max-lora-rank", "8", "--lora-max-staleness", "1")






def greedy(max_tokens: int = STEPS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora_name="policy")


def expected(model, steps: int = STEPS) -> list[int]:
    return greedy_with_logprobs(model, PROMPT, steps)[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import LlamaForCausalLM

    directory = save_tiny_model(tmp_path_factory.mktemp("lora-sync") / "base", seed=4)
    return directory, LlamaForCausalLM.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def fleet(base):
    """(a client of the router, a client of each replica). The router runs in this process (its own
    thread, as `rollout route` runs it): a third interpreter start would double the file's time."""
    directory, _ = base
    args = (*SERVER_ARGS, "--weight-sync-timeout-s", str(TIMEOUT_S), *LORA_ARGS)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # NOTE: the two start side by side
        starting = [pool.submit(ServerProcess, directory, *args, ready_timeout=60) for _ in range(2)]
        concurrent.futures.wait(starting, timeout=120)
    procs = [f.result() for f in starting if f.done() and f.exception() is None]
    try:
        assert len(procs) == 2, [f.exception() for f in starting]
        with RolloutRouter([p.address for p in procs], RouterConfig(health=HEALTH)) as router:
            wait_up(router, 2)
            with RolloutClient(router.address, timeout=30) as client:
                replicas = [RolloutClient(p.address, timeout=30) for p in procs]
                try:
                    yield client, replicas
                finally:
                    for r in replicas:
                        r.close()
    finally:
        for p in procs:
            p.proc.terminate()  # NOTE: both wind down at once, then each is waited for (or killed)
        for p in procs:
            p.stop(grace_s=5.0)


def stat(client: RolloutClient, name: str):
    return client.stats()[name]


def generate(client: RolloutClient, max_tokens: int = STEPS) -> list[int]:
    (rollout,) = client.generate([PROMPT], sampling=greedy(max_tokens), timeout=30)
    return list(rollout.completion_ids)


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
def test_an_adapter_sync_moves_the_adapters_bytes_alone_and_in_flight_requests_keep_their_version(
        fleet, base, transport):
    client, replicas = fleet
    trainer = live_peft(base[1], std=0.2)
    named = list(get_peft_model_state_dict(trainer).items())
    adapter_bytes = sum(t.nbytes for _, t in named)
    model_bytes = sum(p.nbytes for p in base[1].parameters())
    # NOTE: beside the bytes, the control message states the adapter: its manifest is this size on
    # the wire (1,149 bytes here: 14 names, shapes, one bucket's checksum), sent once per replica
    manifest_bytes = len(msgspec.msgpack.encode(manifest_for(named)))
    assert manifest_bytes < adapter_bytes / 4
    with WeightSender([client], transport, replicas=2, timeout_s=TIMEOUT_S, piece_bytes=64 * 1024) as sender:
        first = sender.sync_lora("policy", trainer)
        # every tensor's bytes are a multiple of the 64-byte alignment: the bytes moved are the tensors', no padding
        assert sender.stats.last_bytes == adapter_bytes < model_bytes / 10
        assert [stat(r, "weight_sync/last_lora_bytes") for r in replicas] == [adapter_bytes] * 2
        assert [r.list_loras()[0].version for r in replicas] == [first] * 2
        assert [generate(r) for r in replicas] == [expected(trainer)] * 2

        # a request in flight (pinned to `first`) while the next version lands on both replicas
        started = copy.deepcopy(trainer)
        stream = client.stream([PROMPT], sampling=greedy(3 * STEPS), tokens=True, timeout=30)
        assert isinstance(next(stream), TokenChunk)  # admitted: pinned to the version current now
        client.pause(PauseMode.KEEP)  # NOTE: frozen with its KV, so it is surely mid-decode at the sync
        lora_step(trainer, 0, 0.1)
        assert sender.sync_lora("policy", trainer) == first + 1
        assert [stat(r, "engine/lora_resident_versions") for r in replicas].count(2) == 1  # its replica holds both
        client.continue_()
        (finished,) = stream.result(30)
        assert list(finished.completion_ids) == expected(started, 3 * STEPS)  # the old version, to its end
        wait_for(lambda: [stat(r, "engine/lora_resident_versions") for r in replicas] == [1, 1], 10)
        assert generate(client) == expected(trainer)  # new requests: the new version


def test_fifty_syncs_keep_at_most_staleness_plus_one_versions_and_memory_flat_and_end_on_peft(fleet, base):
    client, replicas = fleet
    trainer = live_peft(base[1], seed=2, std=0.2)
    with WeightSender([client], Transport.GLOO, replicas=2, timeout_s=TIMEOUT_S) as sender:
        start = sender.sync_lora("policy", trainer)
        size = [stat(r, "engine/lora_adapter_bytes") for r in replicas]
        most = 0
        for k in range(SYNCS):
            lora_step(trainer, 100 + k, 0.1)
            stream = client.stream([PROMPT], sampling=greedy(), tokens=True, timeout=30) if k % 10 == 0 else None
            if stream is not None:
                next(stream)  # NOTE: in flight across this sync (it may finish before it, too)
            assert sender.sync_lora("policy", trainer) == start + k + 1
            most = max(most, *(stat(r, "engine/lora_resident_versions") for r in replicas))
            if stream is not None:
                stream.result(30)
        assert most <= 2  # max_staleness + 1
        wait_for(lambda: [stat(r, "engine/lora_resident_versions") for r in replicas] == [1, 1], 10)
        assert [stat(r, "engine/lora_adapter_bytes") for r in replicas] == size  # flat: every old version freed
        assert [r.list_loras()[0].version for r in replicas] == [start + SYNCS] * 2
    assert [generate(r) for r in replicas] == [expected(trainer)] * 2  # HF + PEFT, the adapter unmerged


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
def test_a_refused_adapter_sync_through_the_router_leaves_every_replica_on_the_previous_version(
        fleet, base, transport, monkeypatch):
    """gloo: a bad shape, refused by each replica before a byte moves; shm: a corrupted piece (its
    published checksum off by one bit), refused by each replica's check. The router answers the
    refusal, and both replicas serve on the version they had."""
    from weight_sync import SyncError, memcopy

    client, replicas = fleet
    trainer = live_peft(base[1], seed=3, std=0.2)
    with WeightSender([client], transport, replicas=2, timeout_s=TIMEOUT_S, piece_bytes=64 * 1024) as sender:
        version = sender.sync_lora("policy", trainer)
        served = [generate(r) for r in replicas]
        lora_step(trainer, 7, 0.1)
        named = get_peft_model_state_dict(trainer)
        if transport is Transport.GLOO:
            key = next(k for k in named if k.endswith("v_proj.lora_B.weight"))
            named = {**named, key: torch.zeros(named[key].shape[0] + 1, named[key].shape[1])}
            says = "must be"
        else:
            real = memcopy.publish
            monkeypatch.setattr(memcopy, "publish", lambda h, slot, checksum, token: real(h, slot, checksum ^ 1, token))
            says = "checksum"
        with pytest.raises(SyncError, match=says):
            sender.sync_lora("policy", named, alpha=8.0)
        monkeypatch.undo()
        assert [r.list_loras()[0].version for r in replicas] == [version] * 2
        assert [generate(r) for r in replicas] == served
        assert sender.sync_lora("policy", trainer) == version + 1  # the next sync heals
    assert [generate(r) for r in replicas] == [expected(trainer)] * 2
