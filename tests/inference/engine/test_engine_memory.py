"""The engine's memory knobs and their failure paths: a resume that cannot allocate rolls back,
`paused_block_budget` bounds what paused requests hold, `kv_memory_bytes` sizes the pool.

Each check is run once more against a planted bug and must catch it.
"""

from __future__ import annotations

import pytest
import torch

from inference import (
    BlockOverflowError,
    DynamicInferenceEngine,
    EngineState,
    InferenceConfig,
    ResumeMemoryError,
    SamplingParams,
    SuspendPolicy,
)
from inference.cache.manager import CacheManager
from inference.weights.manager import WeightManager
from tests.inference.engine.conftest import random_prompts, tiny_llama
from tests.inference.models.recurrent import RecurrentDecoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=128, max_requests=8, max_batch_tokens=64, max_sequence_length=64)
    fields.update(overrides)
    return InferenceConfig(**fields)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=13)


def drain(engine):
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return sorted(outputs, key=lambda o: o.request_id)


# ---- resume that cannot allocate ------------------------------------------------------------


def check_failed_resume_rolls_back(model, monkeypatch):
    """Resume restores the offloaded weights, then the KV buffer, then the state pool; when the
    last fails, everything it got is given back and the engine stays suspended, then resumes."""
    engine = DynamicInferenceEngine(RecurrentDecoder.from_hf(model), config())
    prompt = [5, 6, 7, 8, 9]
    expected = engine.generate([prompt], GREEDY)[0].generated_token_ids
    rid = engine.add_request(prompt, GREEDY)
    engine.step()
    engine.suspend(SuspendPolicy.RECOMPUTE, offload_weights=True)
    states = engine.caches.states
    allocate = states.allocate
    monkeypatch.setattr(states, "allocate", lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(ResumeMemoryError, match="still suspended"):
        engine.resume()
    assert engine.state is EngineState.SUSPENDED
    assert not engine.kv_cache.is_allocated, "the KV buffer stayed allocated after a failed resume"
    assert engine.weights.offloaded, "the weights stayed resident after a failed resume"
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.model.named_tensors().values())
    monkeypatch.setattr(states, "allocate", allocate)
    engine.resume()
    outputs = drain(engine)
    assert [o.request_id for o in outputs] == [rid] and outputs[0].generated_token_ids == expected


def test_a_resume_that_cannot_allocate_rolls_back(model, monkeypatch):
    check_failed_resume_rolls_back(model, monkeypatch)


@pytest.fixture
def planted_rollback_forgets_the_weights(monkeypatch):
    """Planted bug: a failed resume does not move the weights it restored back to host."""
    offload, calls = WeightManager.offload, []

    def first_only(self):
        calls.append(self)
        return offload(self) if len(calls) == 1 else 0

    monkeypatch.setattr(WeightManager, "offload", first_only)


@pytest.fixture
def planted_rollback_forgets_the_kv_buffer(monkeypatch):
    """Planted bug: the caches keep the KV buffer when the state pool cannot be allocated."""
    def reacquire(self):
        self.kv.allocate()
        self.states.allocate()

    monkeypatch.setattr(CacheManager, "reacquire", reacquire)


@pytest.mark.parametrize("planted, what", [("planted_rollback_forgets_the_weights", "weights"),
                                           ("planted_rollback_forgets_the_kv_buffer", "KV buffer")])
def test_the_rollback_check_catches_what_a_failed_resume_keeps(model, monkeypatch, planted, what, request):
    request.getfixturevalue(planted)
    with pytest.raises(AssertionError, match=what):
        check_failed_resume_rolls_back(model, monkeypatch)


# ---- paused_block_budget --------------------------------------------------------------------


def paused_blocks_per_step(model, budget):
    """Run 8 requests through a pool that fits ~3; (outputs, blocks held by paused requests after
    each step, preemptions)."""
    engine = DynamicInferenceEngine.from_pretrained(model, config(num_blocks=24, paused_block_budget=budget))
    for prompt in random_prompts(8, 6, 10, seed=81):
        engine.add_request(prompt, GREEDY)
    outputs, paused = [], []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        paused.append(engine.context.paused_block_count())
    return sorted(outputs, key=lambda o: o.request_id), paused, engine.scheduler.num_preemptions


def check_paused_block_budget(model):
    reference = DynamicInferenceEngine.from_pretrained(model, config()).generate(random_prompts(8, 6, 10, seed=81),
                                                                                  GREEDY)
    tight, paused, preempted = paused_blocks_per_step(model, 2)
    assert max(paused) <= 2, f"paused requests held {max(paused)} blocks over a budget of 2"
    assert preempted > 0
    roomy, paused_roomy, _ = paused_blocks_per_step(model, 1000)
    assert max(paused_roomy) > 2  # the budget, not the pool, is what held the tight run down
    for outs in (tight, roomy):
        assert [o.generated_token_ids for o in outs] == [o.generated_token_ids for o in reference]


def test_paused_requests_stay_within_their_block_budget(model):
    check_paused_block_budget(model)


@pytest.fixture
def planted_budget_ignored(monkeypatch):
    """Planted bug: the configured budget is not read (a quarter of the pool instead)."""
    monkeypatch.setattr(InferenceConfig, "resolve_paused_block_budget", lambda self, num_blocks: num_blocks // 4)


def test_the_budget_check_catches_an_ignored_budget(model, planted_budget_ignored):
    with pytest.raises(AssertionError, match="over a budget"):
        check_paused_block_budget(model)


# ---- kv_memory_bytes ------------------------------------------------------------------------


def check_kv_memory_bytes(model):
    spec = DynamicInferenceEngine.from_pretrained(model, config()).model.spec
    per_block = 2 * spec.num_layers * 4 * spec.num_kv_heads * spec.head_dim * 4  # K and V, fp32, 4 tokens
    for budget in (40 * per_block + 100, 64 * per_block):
        engine = DynamicInferenceEngine.from_pretrained(
            model, config(num_blocks=None, kv_memory_bytes=budget, max_sequence_length=512))
        blocks = budget // per_block
        assert engine.allocator.total == blocks, f"{engine.allocator.total} blocks for {budget} bytes"
        assert engine.stats()["kv_cache_bytes"] == engine.kv_cache.nbytes == blocks * per_block <= budget
        with pytest.raises(BlockOverflowError):  # the pool is what the budget holds, no more
            engine.add_request(list(range(3, 3 + 4 * blocks)), SamplingParams(max_tokens=8))
        engine.suspend()
        engine.resume()
        assert engine.kv_cache.nbytes == blocks * per_block
        out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert len(out.generated_token_ids) == 4
    with pytest.raises(ValueError, match="kv_memory_bytes"):
        DynamicInferenceEngine.from_pretrained(model, config(num_blocks=None, kv_memory_bytes=per_block - 1))


def test_kv_memory_bytes_sizes_the_pool(model):
    check_kv_memory_bytes(model)


@pytest.fixture
def planted_memory_budget_ignored(monkeypatch):
    """Planted bug: the byte budget is not read (the 256 MiB default instead)."""
    resolve = InferenceConfig.resolve_num_blocks
    monkeypatch.setattr(InferenceConfig, "resolve_num_blocks",
                        lambda self, per_block: self.num_blocks or resolve(InferenceConfig(), per_block))


def test_the_memory_check_catches_an_ignored_budget(model, planted_memory_budget_ignored):
    with pytest.raises(AssertionError):
        check_kv_memory_bytes(model)


def test_weights_offloaded_at_suspend_are_really_freed(model):
    engine = DynamicInferenceEngine.from_pretrained(model, config())
    report = engine.suspend(offload_weights=True)
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.offloaded_weight_bytes == expected and engine.weights.offloaded_bytes() == expected
    engine.resume()
    assert torch.equal(engine.model.named_tensors()["lm_head.weight"], model.lm_head.weight.detach())
