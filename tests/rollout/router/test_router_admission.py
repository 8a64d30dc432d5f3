"""Fair admission behind a router: the router forwards every client's Generates over its one
connection to a replica, naming the client each is for (`Generate.client`), so the replica's engine
takes turns between the router's clients as it does between its own connections."""

from __future__ import annotations

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, PauseMode, SamplingParams
from rollout import RolloutClient
from rollout.router.router import RolloutRouter, RouterConfig
from rollout.server.server import RolloutServer
from tests.inference.engine.conftest import tiny_llama
from tests.rollout.router.router_util import HEALTH, wait_up
from tests.rollout.service_util import WAIT_S, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = InferenceConfig(block_size=4, num_blocks=256, max_requests=4, max_batch_tokens=64, max_sequence_length=64)
A_PROMPTS, A_N, A_TOKENS = 8, 4, 12  # 8 Generates of 4 samples: each fills every slot


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_a_router_client_is_not_held_behind_all_of_another_s():
    server = RolloutServer(DynamicInferenceEngine.from_pretrained(tiny_llama(layers=1, hidden=32, seed=4),
                                                                  CONFIG)).start()
    finished = []
    deliver = server._sample_finished

    def record_order(record, out, now):  # NOTE: the server's endpoint thread, in the order the engine finished
        finished.append(record.request.prompt_token_ids.tolist())
        deliver(record, out, now)

    server._sample_finished = record_order
    router = RolloutRouter([server.address], RouterConfig(health=HEALTH)).start()
    try:
        wait_up(router, 1)
        engine = server.engine
        with RolloutClient(router.address, timeout=WAIT_S) as a, RolloutClient(router.address, timeout=WAIT_S) as b:
            a.pause(PauseMode.KEEP)  # NOTE: nothing runs until both clients' requests wait at the replica
            huge = a.stream([[3 + i, 40 + i, 7] for i in range(A_PROMPTS)], A_N, greedy(A_TOKENS))
            wait_for(lambda: engine.stats()["waiting_samples"] == A_PROMPTS * A_N)
            small = b.stream([[5, 6]], 1, greedy(2))
            wait_for(lambda: engine.stats()["waiting_clients"] == 2)  # one connection, two clients
            a.continue_()
            assert len(small.result(WAIT_S)) == 1 and len(huge.result(WAIT_S)) == A_PROMPTS * A_N
    finally:
        router.stop()
        router.close()
        server.stop()
    assert finished.index([5, 6]) == A_N  # b's turn comes after a's first Generate (FIFO: after all eight)
