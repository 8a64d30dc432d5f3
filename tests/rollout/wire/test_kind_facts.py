"""What each request kind declares of itself for a router (class attributes and `for_replica`)."""

from __future__ import annotations

from rollout.wire import messages
from rollout.wire.messages import RequestMessage


def _group(rank_offset=None) -> messages.InitWeightsUpdateGroup:
    return messages.InitWeightsUpdateGroup(request_id="g", master_address="127.0.0.1", master_port=29500,
                                           world_size=3, rank_offset=rank_offset)


def test_a_weight_group_with_a_rank_offset_gives_each_replica_its_own_rank():
    join = _group(rank_offset=1)
    assert join.ranked
    assert [join.for_replica(i).rank_offset for i in range(3)] == [1, 2, 3]
    assert join.rank_offset == 1  # NOTE: copies: the broadcast's own message is unchanged
    assert join.for_replica(1).master_port == 29500 and join.for_replica(1).request_id == "g"


def test_without_a_rank_offset_every_replica_gets_the_same_request():
    join = _group()
    assert not join.ranked and join.for_replica(2) is join
    pause = messages.Pause(request_id="p", mode=messages.PauseMode.ABORT)
    assert not pause.ranked and pause.for_replica(5) is pause


def test_only_a_weight_update_commits_a_policy_version():
    assert [cls.__name__ for cls in RequestMessage.__args__ if cls.commits_version] == ["UpdateWeights"]
