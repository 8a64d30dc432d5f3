"""Suspend by part (`kv_cache`, `weights`), each part once, as vLLM's sleep tags and SGLang's memory
tags ask: the colocated flows that wake the weights first (to load new ones) and the KV cache last,
and vLLM's level 2, which drops the weights instead of keeping a host copy."""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, EngineStateError, InferenceConfig, SamplingParams
from tests.inference.engine.conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [1, 17, 29, 31]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def model():
    return tiny_llama(seed=4)


def engine_of(model):
    return DynamicInferenceEngine.from_pretrained(model, InferenceConfig(block_size=4, num_blocks=64, max_requests=4))


def run(engine) -> list[int]:
    return engine.generate([PROMPT], GREEDY)[0].generated_token_ids


def test_parts_sleep_and_wake_one_by_one(model):
    engine = engine_of(model)
    want = run(engine)
    first = engine.suspend(tags=["kv_cache"])
    assert first.buffer_bytes > 0 and first.offloaded_weight_bytes == 0 and engine.core.asleep == {"kv_cache"}
    second = engine.suspend(tags=["weights"])
    assert second.buffer_bytes == 0 and second.offloaded_weight_bytes > 0
    assert engine.core.asleep == {"kv_cache", "weights"}
    assert engine.suspend(tags=["weights", "kv_cache"]).offloaded_weight_bytes == 0  # asleep: nothing to do
    engine.resume(tags=["weights"])  # slime's order: the weights first (new ones come in), then the KV cache
    assert engine.core.asleep == {"kv_cache"} and engine.state.value == "suspended"
    engine.resume(tags=["weights"])  # awake already: a no-op, not an error
    engine.resume(tags=["kv_cache"])
    assert not engine.core.asleep and engine.state.value == "running"
    assert run(engine) == want
    with pytest.raises(EngineStateError, match="without suspend"):
        engine.resume()
    engine.resume(tags=["kv_cache"])  # a part awake: nothing to do
    with pytest.raises(ValueError, match="tags must name"):
        engine.suspend(tags=["cuda_graph_pool"])
    assert run(engine) == want


def test_level_two_drops_the_weights_until_an_update_loads_them(model):
    engine = engine_of(model)
    want = run(engine)
    own = {n: t.detach().clone() for n, t in model.state_dict().items()}
    weight_bytes = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t
                                                              for t in engine.model.named_tensors().values()}.values())
    report = engine.suspend(tags=["kv_cache", "weights"], discard_weights=True)
    assert report.offloaded_weight_bytes == weight_bytes
    assert engine.core.weights.offloaded_bytes() == 0  # no host copy kept
    engine.resume(tags=["weights", "kv_cache"])
    with pytest.raises(EngineStateError, match="discarded"):
        run(engine)  # awake, but with no weights in its tensors: refused, not garbage
    engine.suspend(tags=["kv_cache"])
    engine.update_weights(own)  # the trainer sends the weights while the KV cache still sleeps
    engine.resume(tags=["kv_cache"])
    assert run(engine) == want


def test_a_suspended_engine_refuses_work_until_every_part_wakes(model):
    engine = engine_of(model)
    engine.suspend(tags=["weights"])
    with pytest.raises(Exception, match="suspended"):
        run(engine)
    engine.resume(tags=["weights"])
    assert run(engine)


def test_no_tags_keeps_the_old_meaning(model):
    engine = engine_of(model)
    want = run(engine)
    assert engine.suspend().offloaded_weight_bytes == 0 and engine.core.asleep == {"kv_cache"}
    engine.resume()
    assert engine.suspend(offload_weights=True).offloaded_weight_bytes > 0
    assert engine.core.asleep == {"kv_cache", "weights"}
    engine.resume()
    assert run(engine) == want and torch.is_grad_enabled()
