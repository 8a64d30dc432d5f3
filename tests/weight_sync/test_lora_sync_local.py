"""Adapter-only syncs into in-process replicas (a `WeightReceiver` each, as a server has): only the
adapter's tensors move, each sync is the adapter's next version, and what the engine cannot serve
(a bad shape, a target it cannot adapt, a corrupted byte) refuses the whole update with its typed
error while the previous version serves on, on every replica."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.errors import LoRAShapeError, LoRATargetError
from tests.inference.lora.peft_adapters import ALL_LINEAR, greedy_with_logprobs, live_peft, lora_step
from tests.weight_sync.local import LocalControl, corrupting_pipeline, tiny_llama
from weight_sync import AdapterConfig, SyncError, Transport, WeightSender, memcopy
from weight_sync.lora_sync import peft_adapter
from weight_sync.manifest import ChecksumError
from weight_sync.receiver import WeightReceiver
from weight_sync.transports import distributed

PROMPT = [1, 5, 9, 13, 2, 7]
STEPS = 6
TIMEOUT_S = 5.0
PARAMS = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, lora_name="policy")

pytestmark = pytest.mark.usefixtures("one_torch_thread")






@pytest.fixture(scope="module")
def base():
    return tiny_llama(3)


@pytest.fixture
def replicas(base):
    config = InferenceConfig(block_size=4, num_blocks=64, max_requests=8, max_batch_tokens=64, max_sequence_length=64,
                             max_loras=2, max_lora_rank=8, lora_max_staleness=1)
    engines = [DynamicInferenceEngine.from_pretrained(base, config) for _ in range(2)]
    receivers = [WeightReceiver(e, timeout_s=TIMEOUT_S) for e in engines]
    yield engines, receivers
    for r in receivers:
        r.close()


def served(engine) -> list[int]:
    return engine.generate([PROMPT], PARAMS)[0].generated_token_ids


def sender_of(receivers, transport) -> WeightSender:
    return WeightSender([LocalControl(r) for r in receivers], transport, timeout_s=TIMEOUT_S, piece_bytes=64 * 1024)


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
def test_only_the_adapter_moves_and_each_sync_is_its_next_version(replicas, base, transport):
    engines, receivers = replicas
    trainer = live_peft(base, std=0.2)
    adapter_bytes = sum(t.nbytes for t in get_peft_model_state_dict(trainer).values())
    with sender_of(receivers, transport) as sender:
        for version in (1, 2, 3):
            assert sender.sync_lora("policy", trainer) == version
            # NOTE: every tensor's bytes are a multiple of the 64-byte alignment: no padding moves
            assert sender.stats.last_bytes == adapter_bytes
            assert [r.stats.last_lora_bytes for r in receivers] == [adapter_bytes] * 2
            expected = greedy_with_logprobs(trainer, PROMPT, STEPS)[0]
            assert [served(e) for e in engines] == [expected] * 2
            lora_step(trainer, version, 0.1)
    assert [e.policy_version for e in engines] == [0, 0]  # the base weights never moved
    assert [r.stats.updates_committed for r in receivers] == [0, 0]


def test_named_tensors_with_their_config_sync_as_the_peft_model_does(replicas, base):
    engines, receivers = replicas
    trainer = live_peft(base, std=0.2)
    named = get_peft_model_state_dict(trainer)
    with sender_of(receivers, Transport.GLOO) as sender:
        assert sender.sync_lora("policy", named, version=7, alpha=8.0) == 7
        with pytest.raises(SyncError, match="not newer"):
            sender.sync_lora("policy", named, version=7, alpha=8.0)
    assert [e.list_loras()[0].version for e in engines] == [7, 7]
    assert served(engines[0]) == greedy_with_logprobs(trainer, PROMPT, STEPS)[0]


def test_a_peft_models_adapter_is_what_peft_saves_and_what_the_engine_refuses_is_refused_at_the_trainer(base):
    trainer = live_peft(base, std=0.2)
    named, config = peft_adapter(trainer)
    saved = get_peft_model_state_dict(trainer)
    assert [n for n, _ in named] == list(saved) and all(t is saved[n] or torch.equal(t, saved[n]) for n, t in named)
    assert config == AdapterConfig(rank=4, alpha=8.0, rslora=False, target_modules=tuple(sorted(ALL_LINEAR)))
    dora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(LoRATargetError, match="DoRA"):
        peft_adapter(dora)


def bad_shape(named: dict) -> dict:
    key = next(k for k in named if k.endswith("q_proj.lora_A.weight"))
    return {**named, key: torch.zeros(named[key].shape[0], named[key].shape[1] + 1)}


def unknown_target(named: dict) -> dict:
    some = next(iter(named.values()))
    extra = {f"base_model.model.model.embed_tokens.lora_{ab}.weight": torch.zeros_like(some) for ab in "AB"}
    return {**named, **extra}


@pytest.mark.parametrize("transport", [Transport.GLOO, Transport.SHM])
@pytest.mark.parametrize("fault,error", [(bad_shape, LoRAShapeError), (unknown_target, LoRATargetError),
                                         ("corrupt", ChecksumError)])
def test_a_refused_adapter_update_changes_nothing_and_the_previous_version_serves(replicas, base, transport, fault,
                                                                                  error, monkeypatch):
    engines, receivers = replicas
    trainer = live_peft(base, std=0.2)
    with sender_of(receivers, transport) as sender:
        assert sender.sync_lora("policy", trainer) == 1
        before = [served(e) for e in engines]
        lora_step(trainer, 0, 0.1)
        named = get_peft_model_state_dict(trainer)
        if fault == "corrupt":
            if transport is Transport.GLOO:
                monkeypatch.setattr(distributed.WeightGroup, "pipeline", corrupting_pipeline(bucket=0)[0])
            else:
                real = memcopy.publish
                monkeypatch.setattr(memcopy, "publish", lambda h, slot, checksum, token: real(h, slot, checksum ^ 1,
                                                                                              token))
        else:
            named = fault(named)
        with pytest.raises(SyncError) as refused:
            sender.sync_lora("policy", named, alpha=8.0)
        assert [type(r) for r in refused.value.replies] == [error] * 2  # each replica's own typed reason
        monkeypatch.undo()
        assert [[(i.name, i.version) for i in e.list_loras()] for e in engines] == [[("policy", 1)]] * 2
        assert [served(e) for e in engines] == before  # the previous version serves on
        assert [r.stats.lora_updates_aborted for r in receivers] == [1, 1]  # every replica refused it
        assert [e.core.loras.resident_versions for e in engines] == [1, 1]  # nothing half-built kept
        assert sender.sync_lora("policy", trainer) == 2  # the next sync heals
    assert served(engines[1]) == greedy_with_logprobs(trainer, PROMPT, STEPS)[0]
