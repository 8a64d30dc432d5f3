"""Replicas as Ray actors on a local Ray instance (CPU), behind a router: the router's guarantees
hold, and killing an actor triggers failover and a replacement. Skipped cleanly without Ray.

Every Ray call is bounded (the supervisor's `call_timeout_s` / `ready_timeout_s`); `ray.init`
itself has no timeout parameter: it is started once for the module and always shut down.
"""

from __future__ import annotations

from collections import Counter

import pytest

from rollout import RolloutClient, RolloutRouter, RouterConfig
from rollout.router.links import ReplicaState
from tests.rollout.router.router_util import HEALTH, wait_up
from tests.rollout.server.test_service import run_concurrent_clients
from tests.rollout.service_util import SERVER_ARGS, WAIT_S, expected_outputs, greedy, random_prompts, wait_for

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_router(local_ray, service_model_dir):
    from rollout.router.ray import RayReplicas, ReplicaResources

    router = RolloutRouter([], RouterConfig(health=HEALTH)).start()
    replicas = RayReplicas(router, service_model_dir, 2, SERVER_ARGS, resources=ReplicaResources(num_cpus=1),
                           call_timeout_s=20.0, ready_timeout_s=120.0, check_every_s=0.25)
    try:
        replicas.start()
        wait_up(router, 2)
        yield router, replicas
    finally:
        replicas.stop()
        router.stop()
        router.close()


def test_two_hundred_requests_through_ray_actors(ray_router, reference):
    router, replicas = ray_router
    assert all(a.startswith("tcp://127.0.0.1:") for a in replicas.endpoints())  # only endpoint strings
    run_concurrent_clients(router, reference, total=200)  # each answered once, greedy == in process


def test_killing_an_actor_fails_over_and_replaces_it(ray_router, reference):
    router, replicas = ray_router
    prompts = random_prompts(200, 2, 10, seed=81)
    want = expected_outputs(reference, prompts, [greedy(30)] * len(prompts))
    (victim_name, (actor, _)), *_ = replicas.handles.items()
    got = []
    with RolloutClient(router.address, timeout=WAIT_S) as client:
        for item in client.stream(prompts, 1, greedy(30)):
            got.append(item)
            if len(got) == 40:
                ray.kill(actor)
    assert Counter(r.group for r in got) == Counter(range(len(prompts)))  # none lost, none twice
    assert sorted((r.group, r.completion_ids) for r in got) == [(g, w[0]) for g, w in enumerate(want)]
    wait_for(lambda: victim_name not in router.replicas())  # the supervisor took it out (bounded wait)
    wait_for(lambda: replicas.replacements == 1, timeout=2 * WAIT_S)
    infos = wait_up(router, 2)
    assert len(infos) == 2 and all(i.state is ReplicaState.UP for i in infos.values())
    with RolloutClient(router.address, timeout=WAIT_S) as client:
        assert client.generate([[5, 6, 7]], 1, greedy(3))[0].completion_ids == \
            expected_outputs(reference, [[5, 6, 7]], [greedy(3)])[0][0]
