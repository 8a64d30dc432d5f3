"""Releasing the calling thread's OpenMP workers (`omp_pool.py`) before the engine loop takes the steps."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.core import loop as loop_module
from inference.core import omp_pool
from tests.inference.engine.conftest import random_prompts, tiny_llama


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def in_a_thread(fn):
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(result=fn()))
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    return box["result"]


@pytest.mark.skipif(omp_pool._runtime() is None or (os.cpu_count() or 1) < 2 or not os.path.exists("/proc/self/task"),
                    reason="needs an OpenMP runtime torch loaded and two cores")
def test_the_callers_workers_exit_and_come_back_at_its_next_parallel_op():
    def run():
        torch.set_num_threads(2)
        torch.ones(8_000_000).sum()  # NOTE: a parallel region: this thread now has a pool of workers
        with_pool = os_threads()
        assert omp_pool.release_caller_pool()
        deadline = time.monotonic() + 10
        while os_threads() >= with_pool and time.monotonic() < deadline:
            time.sleep(0.01)
        released = os_threads()
        torch.ones(8_000_000).sum()
        return with_pool, released, os_threads()

    with_pool, released, again = in_a_thread(run)
    assert released == with_pool - 1 and again == with_pool


def test_starting_the_loop_releases_the_starting_threads_pool_and_the_engine_serves(monkeypatch):
    released = []
    real = loop_module.release_caller_pool
    monkeypatch.setattr(loop_module, "release_caller_pool",
                        lambda: released.append(threading.current_thread()) or real())
    engine = DynamicInferenceEngine.from_pretrained(
        tiny_llama(), InferenceConfig(block_size=4, num_blocks=64, max_requests=4, max_sequence_length=64))
    prompts = random_prompts(3, 4, 12, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    stepped_here = [o.generated_token_ids for o in engine.generate(prompts, greedy)]
    engine.reset_prefix_cache()
    engine.start()
    try:
        assert released == [threading.current_thread()]
        assert [o.generated_token_ids for o in engine.generate(prompts, greedy)] == stepped_here
    finally:
        engine.stop()
