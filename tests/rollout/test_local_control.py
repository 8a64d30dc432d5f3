"""RolloutEngine's control calls are a client's (`rollout.control`), answered by the engine
service in the caller's thread: a WAIT pause without a background loop returns once the engine
drained (the caller steps it), a suspend without a policy follows the engine's configured one (as
a server's does now), and what a server answers the local engine answers too."""

from __future__ import annotations

import dataclasses

import pytest

from inference import InferenceConfig, PauseMode, SamplingParams, SuspendPolicy
from rollout.client.sync import RolloutClient
from rollout.local import RolloutEngine
from rollout.server.server import RolloutServer
from rollout.types import FinishReason, Rollout, TokenChunk
from weight_sync import CheckpointError

from .conftest import small_engine_config, tiny_policy

LONG = SamplingParams(max_tokens=20, ignore_eos=True)


def aborting_config() -> InferenceConfig:
    return dataclasses.replace(small_engine_config(), suspend_policy=SuspendPolicy.ABORT)


def test_a_wait_pause_without_a_loop_returns_once_drained_and_holds_new_requests():
    local = RolloutEngine(tiny_policy(), small_engine_config())
    assert not local.engine.loop_running
    stream = local.stream([[1, 2, 3]], n=2, sampling=LONG, tokens=True)
    assert isinstance(next(stream), TokenChunk)  # it runs
    local.pause(PauseMode.WAIT, timeout=30.0)  # NOTE: bounded: a drain that never comes fails, not hangs
    assert local.engine.core.drained()
    finished = [item for item in stream if isinstance(item, Rollout)]
    assert [len(r.completion_ids) for r in finished] == [20, 20]  # finished, not aborted, before it returned
    queued = local.stream([[1, 4]], n=1, sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    local.engine.step()
    assert local.engine.has_unfinished_requests() and local.engine.core.drained()  # paused: queued, not admitted
    local.continue_()
    assert len(queued.result()[0].completion_ids) == 3
    local.close()


def test_a_suspend_without_a_policy_follows_the_engines_configured_one_local_and_served():
    local = RolloutEngine(tiny_policy(), aborting_config())
    stream = local.stream([[1, 2, 3]], n=2, sampling=LONG, tokens=True)
    next(stream)
    report = local.suspend()
    assert report.requests_aborted == 2 and local.is_sleeping() and local.health().state == "suspended"
    assert {r.finish_reason for r in stream.result()} == {FinishReason.ABORT}
    local.resume()
    assert not local.is_sleeping()
    local.close()

    server = RolloutServer(RolloutEngine(tiny_policy(), aborting_config()).engine).start()
    try:
        with RolloutClient(server.address, timeout=30.0) as client:
            served = client.stream([[1, 2, 3]], n=2, sampling=LONG, tokens=True)
            next(iter(served))
            assert client.suspend().requests_aborted == 2
            assert {r.finish_reason for r in served.result()} == {FinishReason.ABORT}
            client.resume()
    finally:
        server.stop()


@pytest.mark.parametrize("policy", [SuspendPolicy.RECOMPUTE, "recompute"])
def test_a_policy_given_overrides_the_configured_one(policy):
    local = RolloutEngine(tiny_policy(), aborting_config())
    stream = local.stream([[1, 2, 3]], n=1, sampling=LONG, tokens=True)
    next(stream)
    report = local.suspend(policy)
    assert report.requests_aborted == 0 and report.requests_to_recompute == 1
    local.resume()
    assert [len(r.completion_ids) for r in stream.result()] == [20]
    local.close()


def test_weights_from_a_directory_reach_the_local_engine_through_its_receiver(tmp_path):
    from tests.rollout.service_util import save_tiny_model

    local = RolloutEngine(save_tiny_model(tmp_path / "a", seed=0), small_engine_config())
    other = save_tiny_model(tmp_path / "b", seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = local.generate([[1, 5, 6]], 1, greedy)[0].completion_ids
    assert local.update_weights(other, version=3) == 3 and local.weight_version() == 3
    after = local.generate([[1, 5, 6]], 1, greedy)[0]
    assert after.versions == [3] * 6
    expected = RolloutEngine(other, small_engine_config()).generate([[1, 5, 6]], 1, greedy)[0].completion_ids
    assert after.completion_ids == expected and expected != before  # the other weights, exactly
    with pytest.raises(ValueError, match="named tensors"):
        local.update_weights(other, partial=True)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        local.update_weights(tmp_path / "missing")
    assert local.policy_version == 3  # a refused update changed nothing
    local.close()
    assert local.update_weights(other, version=4) == 4  # closed: its loop and receiver, not the engine
    local.close()
