"""Versioned sync of a trainer's live PEFT adapter into the engine (adapter tensors only): each sync
is the adapter's next version, requests in flight finish on the version they started with (PIN),
at most `lora_max_staleness + 1` versions are ever resident, and memory stays flat over 50 syncs."""

from __future__ import annotations

import pytest
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.errors import LoRACapacityError
from tests.inference.lora.peft_adapters import greedy_with_logprobs, live_peft, lora_step
from tests.inference.models.dense.test_decoder_parity import tiny_hf

PROMPT = [5, 17, 99, 42, 7, 300, 12, 8, 77]
STEPS = 6
SYNCS = 50


pytestmark = pytest.mark.usefixtures("one_torch_thread")






def reference_of(base, state: dict):
    model = live_peft(base, std=0.1)
    set_peft_model_state_dict(model, state)
    return model


def test_fifty_syncs_pin_in_flight_requests_and_keep_memory_flat():
    base = tiny_hf("llama")
    trainer = live_peft(base, std=0.1)
    engine = DynamicInferenceEngine.from_pretrained(base, InferenceConfig(
        block_size=4, num_blocks=64, max_requests=8, max_batch_tokens=32, max_sequence_length=32,
        max_loras=1, max_lora_rank=8, lora_max_staleness=1))
    loras = engine.core.loras
    assert engine.load_lora_from_peft("policy", trainer).version == 1
    size = loras.adapter_bytes
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, lora_name="policy")
    checked, most_resident = [], 0
    for k in range(SYNCS):
        snapshot = {n: t.clone() for n, t in get_peft_model_state_dict(trainer).items()}
        stream = engine.submit(PROMPT, params)
        for _ in range(2):
            engine.step()  # NOTE: the request is mid-decode when the next version lands
        lora_step(trainer, k, 0.05)
        assert engine.load_lora_from_peft("policy", trainer).version == k + 2
        most_resident = max(most_resident, loras.resident_versions)
        while engine.has_unfinished_requests():
            engine.step()
        if k in (0, SYNCS // 2, SYNCS - 1):
            checked.append((stream.result(5)[0].generated_token_ids, snapshot))
    assert most_resident == 2  # the current version and the one in flight, never more
    assert loras.resident_versions == 1 and loras.adapter_bytes == size  # flat: old versions freed
    for tokens, snapshot in checked:  # each request ran on the version it started with, to its end
        assert tokens == greedy_with_logprobs(reference_of(base, snapshot), PROMPT, STEPS)[0]
    (latest,) = engine.generate([PROMPT], params)
    assert latest.generated_token_ids == greedy_with_logprobs(trainer, PROMPT, STEPS)[0]

    first = engine.submit(PROMPT, params)
    engine.step()
    engine.load_lora_from_peft("policy", trainer)  # version 52 while 51 is in flight
    second = engine.submit(PROMPT, params)
    engine.step()
    with pytest.raises(LoRACapacityError, match="max_staleness=1"):  # 51 and 52 in use: a third is refused
        engine.load_lora_from_peft("policy", trainer)
    assert loras.resident_versions == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert first.result(5) and second.result(5)
    assert engine.load_lora_from_peft("policy", trainer).version == 53 and loras.resident_versions == 1
