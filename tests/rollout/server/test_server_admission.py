"""Admission behind a server: it names each ZMQ connection to the engine, which admits them in turns
(one connection's many Generates do not hold another's behind all of them), and past the engine's
waiting bound a Generate is answered OVERLOADED while the server serves on. The in-process client
beside it names each of its calls."""

from __future__ import annotations

import asyncio

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, PauseMode, SamplingParams
from rollout import RolloutClient
from rollout.client.in_process import InProcessClient
from rollout.server.server import RolloutServer
from rollout.wire.codec import ProtocolError
from rollout.wire.kinds import ErrorCode
from tests.inference.engine.conftest import tiny_llama
from tests.rollout.service_util import WAIT_S, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = InferenceConfig(block_size=4, num_blocks=256, max_requests=4, max_batch_tokens=64, max_sequence_length=64,
                         max_waiting_samples=34)
A_PROMPTS, A_N, A_TOKENS = 8, 4, 12  # 8 Generates of 4 samples: each fills every slot


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def served():
    server = RolloutServer(DynamicInferenceEngine.from_pretrained(tiny_llama(layers=1, hidden=32, seed=4),
                                                                  CONFIG)).start()
    try:
        yield server
    finally:
        server.stop()


def test_a_connection_s_generate_is_not_held_behind_all_of_another_s(served):
    engine, finished = served.engine, []
    deliver = served._sample_finished

    def record_order(record, out, now):  # NOTE: the endpoint's thread, in the order the engine finished them
        finished.append(record.request.prompt_token_ids.tolist())
        deliver(record, out, now)

    served._sample_finished = record_order
    try:
        with RolloutClient(served.address, timeout=WAIT_S) as a, RolloutClient(served.address, timeout=WAIT_S) as b:
            a.pause(PauseMode.KEEP)  # NOTE: nothing runs until both connections' requests wait
            huge = a.stream([[3 + i, 40 + i, 7] for i in range(A_PROMPTS)], A_N, greedy(A_TOKENS))
            wait_for(lambda: engine.stats()["waiting_samples"] == A_PROMPTS * A_N)
            small = b.stream([[5, 6]], 1, greedy(2))
            wait_for(lambda: engine.stats()["waiting_clients"] == 2)
            a.continue_()
            assert len(small.result(WAIT_S)) == 1 and len(huge.result(WAIT_S)) == A_PROMPTS * A_N
    finally:
        del served._sample_finished
    # b's turn comes after a's first Generate (FIFO: after all eight)
    assert finished.index([5, 6]) == A_N


def test_past_the_waiting_bound_a_generate_is_answered_overloaded(served):
    with RolloutClient(served.address, timeout=WAIT_S) as a, RolloutClient(served.address, timeout=WAIT_S) as b:
        a.pause(PauseMode.KEEP)
        try:
            queued = a.stream([[3 + i, 9] for i in range(A_PROMPTS)], A_N, greedy(3))  # 32 of 34
            wait_for(lambda: served.engine.stats()["waiting_samples"] == A_PROMPTS * A_N)
            with pytest.raises(ProtocolError, match="max_waiting_samples=34") as refused:
                b.generate([[5, 6]], 4, greedy(3))
            assert refused.value.code is ErrorCode.OVERLOADED
            stats = b.stats()
            assert (stats["engine/waiting_samples"], stats["engine/max_waiting_samples"]) == (32, 34)
        finally:
            a.continue_()
        assert len(queued.result(WAIT_S)) == A_PROMPTS * A_N
        assert len(b.generate([[5, 6]], 4, greedy(3))) == 4  # drained: taken again


def test_each_in_process_call_is_a_client_of_its_own(served):
    engine = served.engine

    def all_waiting():  # both calls' samples, by client, once the engine has them all
        by_client = engine.waiting_by_client()
        return by_client if sum(by_client.values()) == A_PROMPTS * A_N + 1 else None

    async def body():
        local = InProcessClient(engine, served.receiver, timeout=WAIT_S)
        try:
            await local.pause(PauseMode.KEEP)
            huge = local.stream([[3 + i, 9] for i in range(A_PROMPTS)], A_N, greedy(3))
            small = local.stream([[5, 6]], 1, greedy(3))
            waiting = await asyncio.to_thread(wait_for, all_waiting)
            await local.continue_()
            return waiting, len(await huge.result()), len(await small.result())
        finally:
            await local.close()

    waiting, huge, small = asyncio.run(body())
    assert sorted(waiting.values()) == [1, A_PROMPTS * A_N] and (huge, small) == (A_PROMPTS * A_N, 1)


def test_the_serve_flags_set_the_admission_bounds(tmp_path):
    import argparse

    from rollout.server.serve import add_serve_arguments, build_server
    from tests.rollout.service_util import save_tiny_model

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model", str(save_tiny_model(tmp_path / "m")), "--port", "0", "--threads", "1",
                              "--num-blocks", "64", "--max-waiting-samples", "100", "--max-samples-per-request", "40"])
    server = build_server(args)
    try:
        stats = server.engine.stats()
        assert (stats["max_waiting_samples"], stats["max_samples_per_request"]) == (100, 40)
    finally:
        server.close()
