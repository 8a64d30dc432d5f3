"""submit_each (one command, each request accepted or refused on its own) and a WAIT pause that
returns at once (`wait=False`) with `wait_drained()` doing the waiting: what a server needs."""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, EngineState, InferenceConfig, PauseMode, SamplingParams
from tests.inference.engine.conftest import VOCAB, tiny_llama


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = DynamicInferenceEngine.from_pretrained(tiny_llama(layers=1, hidden=32, seed=2),
                                                 InferenceConfig(block_size=4, num_blocks=64, max_sequence_length=32))
    yield eng
    eng.stop()
    torch.set_num_threads(threads)


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("loop", [False, True])
def test_submit_each_refuses_only_the_bad_ones(engine, loop):
    if loop and not engine.loop_running:
        engine.start()
    want = [o.generated_token_ids for o in engine.generate([[5, 6], [7, 8, 9]], greedy(4))]
    seen: list = []
    out = engine.submit_each([[5, 6], [5, VOCAB], [7, 8, 9], [1] * 40], [greedy(4), greedy(4), greedy(4, n=2),
                                                                           greedy(4)],
                             stream_tokens=[True, False, False, False], callbacks=[seen.append, None, None, None])
    assert isinstance(out[1], ValueError) and "outside the vocabulary" in str(out[1])
    assert "max_sequence_length" in str(out[3])
    assert out[0].result(30)[0].generated_token_ids == want[0]
    assert [o.generated_token_ids for o in out[2].result(30)] == [want[1]] * 2
    assert len(seen) == 5  # 4 token events, then the output, through the callback
    with pytest.raises(ValueError, match="3 stream_tokens"):
        engine.submit_each([[5]], None, stream_tokens=[True] * 3)


def test_pause_wait_without_waiting(engine):
    if not engine.loop_running:
        engine.start()
    stream = engine.submit([3, 4, 5], greedy(20), stream_tokens=True)
    next(stream.items(30))  # admitted: its first token is out
    engine.pause(PauseMode.WAIT, wait=False)  # returns at once; admitted requests run on
    assert engine.state is EngineState.PAUSED
    engine.wait_drained(timeout=30)
    assert stream.done() and len(stream.result(0)[0].generated_token_ids) == 20
    engine.continue_()
