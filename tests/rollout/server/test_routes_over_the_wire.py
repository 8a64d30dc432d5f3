"""MoE routing over the wire: a remote trainer gets the routes it replays, equal to in process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference import DynamicInferenceEngine, FinishReason, InferenceConfig, SamplingParams
from rollout import RolloutClient, RolloutEngine
from rollout.server.server import RolloutServer
from rollout.wire.codec import decode, encode
from rollout.wire.messages import RoutedExperts, SampleOutput
from tests.inference.models.moe.tiny import tiny_moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 9, 11, 3, 40, 41], [7, 8, 100, 101, 102, 103, 104, 105, 106]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_routed_experts=True)


CONFIG = InferenceConfig(block_size=4, num_blocks=128, max_requests=8, max_batch_tokens=32, max_sequence_length=64)


def test_a_remote_sample_carries_the_routes_of_the_in_process_one():
    local = RolloutEngine(tiny_moe("qwen3_moe"), CONFIG).generate(PROMPTS, 2, PARAMS)
    server = RolloutServer(DynamicInferenceEngine.from_pretrained(tiny_moe("qwen3_moe"), CONFIG)).start()
    try:
        with RolloutClient(server.address, timeout=60) as client:
            remote = client.generate(PROMPTS, 2, PARAMS)
    finally:
        server.stop()
    assert len(remote) == len(local) == 4
    for mine, theirs in zip(sorted(local, key=lambda r: (r.group, r.sample_index)),
                            sorted(remote, key=lambda r: (r.group, r.sample_index))):
        assert theirs.completion_ids == mine.completion_ids
        assert mine.routed_experts is not None and theirs.routed_experts is not None
        # one row per position fed to the model: the prompt and all generated tokens but the last
        assert theirs.routed_experts.shape[0] == len(mine.prompt_ids) + len(mine.completion_ids) - 1
        np.testing.assert_array_equal(theirs.routed_experts, mine.routed_experts)


def test_routes_that_do_not_fit_the_sample_are_refused():
    routes = RoutedExperts(layers=2, k=2, experts=np.zeros(4 * 2 * 2, dtype=np.int32))  # 4 positions
    fields = dict(request_id="r", sample_index=0, n=1, prompt_len=3, token_ids=[5, 6], logprobs=[0.0, 0.0],
                  versions=[0, 0], finish_reason=FinishReason.LENGTH)
    assert decode(encode(SampleOutput(**fields, routed_experts=routes))).routed_experts.array.shape == (4, 2, 2)
    with pytest.raises(ValueError, match="routed_experts"):
        SampleOutput(**{**fields, "token_ids": [5], "logprobs": [0.0], "versions": [0]}, routed_experts=routes)
    with pytest.raises(ValueError, match="whole positions"):
        RoutedExperts(layers=2, k=2, experts=np.zeros(7, dtype=np.int32))
    assert torch.tensor(routes.array).dtype == torch.int32


def test_routes_asked_of_a_dense_model_are_a_typed_refusal_and_the_engine_serves_on(server):
    from rollout.wire.codec import ProtocolError
    from tests.rollout.service_util import WAIT_S

    with RolloutClient(server.address, timeout=WAIT_S) as client:
        with pytest.raises(ProtocolError, match="return_routed_experts"):
            client.generate([[5, 6, 7]], 1, PARAMS)
        # NOTE: EOS ignored: sampled at temperature 1, the tiny model's EOS (id 2) ends it early now and then
        again = SamplingParams(max_tokens=2, ignore_eos=True)
        assert len(client.generate([[5, 6, 7]], 1, again)[0].completion_ids) == 2
