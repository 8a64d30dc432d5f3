"""`InferenceConfig.prefault_kv`: the KV pool's pages are backed when it is allocated (at start and on
each resume), as vLLM allocates its cache; without it, only as requests first write them. Measured
by the process's resident memory."""

from __future__ import annotations

import os

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.cache import memory
from tests.inference.engine.conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MIB = 2**20
POOL = 64 * MIB


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def grown_by(make) -> tuple[int, object]:
    before = resident_bytes()
    made = make()
    return resident_bytes() - before, made


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")


@needs_proc
@pytest.mark.parametrize("populate_advice", [memory.MADV_POPULATE_WRITE, -1], ids=["madvise", "a-write-per-page"])
def test_a_resident_buffer_is_backed_at_allocation_and_reads_zeros(monkeypatch, populate_advice):
    monkeypatch.setattr(memory, "MADV_POPULATE_WRITE", populate_advice)  # NOTE: -1: refused, as an old kernel
    grew, lazy = grown_by(lambda: memory.returnable_zeros((POOL // 4,), torch.float32, torch.device("cpu")))
    assert grew < POOL // 4
    grew, resident = grown_by(lambda: memory.returnable_zeros((POOL // 4,), torch.float32, torch.device("cpu"),
                                                              resident=True))
    assert grew > POOL * 7 // 8
    assert not resident.any() and not lazy.any()


@needs_proc
def test_prefault_kv_backs_the_pool_at_start_and_on_resume():
    model = tiny_llama(seed=5)
    config = dict(block_size=4, max_requests=8, max_batch_tokens=64, max_sequence_length=64, kv_memory_bytes=POOL)
    grew, lazy = grown_by(lambda: DynamicInferenceEngine.from_pretrained(model, InferenceConfig(**config)))
    assert grew < POOL // 4
    grew, engine = grown_by(lambda: DynamicInferenceEngine.from_pretrained(
        model, InferenceConfig(**config, prefault_kv=True)))
    assert grew > POOL * 7 // 8
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = lazy.generate([[3, 4, 5]], greedy)[0].generated_token_ids
    engine.suspend()
    grew, _ = grown_by(engine.resume)
    assert grew > POOL * 7 // 8
    assert engine.generate([[3, 4, 5]], greedy)[0].generated_token_ids == want
