"""Shared by the router tests: replica processes with test hooks started together, a router over
them that answers fast, and waits that never hang."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rollout import RolloutClient, ServerProcess
from rollout.router.links import HealthConfig, ReplicaState
from tests.rollout.service_util import HOOKED_ENTRY, SERVER_ARGS, WAIT_S, wait_for

# polls every 0.1 s; out after 2 s of silence or a loop stalled for 1.5 s (a tiny model's step is ms)
HEALTH = HealthConfig(every_s=0.1, dead_after_s=2.0, stall_deadline_s=1.5, kv_every_s=0.03)


def start_replica(model_dir: Path, slow_file: Path) -> ServerProcess:
    """A `rollout serve` with test hooks (SIGUSR1 wedges its loop, `slow_file` slows its steps)."""
    env = dict(os.environ, ROLLOUT_TEST_SLOW_FILE=str(slow_file))
    return ServerProcess(model_dir, *SERVER_ARGS, entry=HOOKED_ENTRY, ready_timeout=WAIT_S, env=env)


def start_replicas(model_dir: Path, slow_files: list[Path]) -> list[ServerProcess]:
    with ThreadPoolExecutor(len(slow_files)) as pool:
        futures = [pool.submit(start_replica, model_dir, f) for f in slow_files]
        procs, errors = [], []
        for f in futures:
            try:
                procs.append(f.result(2 * WAIT_S))
            except Exception as exc:  # noqa: BLE001 (raised below, after the others are stopped)
                errors.append(exc)
    if errors:
        for p in procs:
            p.stop(grace_s=5.0)
        raise errors[0]
    return procs


def wait_up(router, count: int, timeout: float = WAIT_S) -> dict:
    return wait_for(lambda: (infos := router.replicas()) and sum(i.state is ReplicaState.UP
                                                                 for i in infos.values()) >= count and infos, timeout)


def name_of(router, proc: ServerProcess) -> str:
    (name,) = [n for n, info in router.replicas().items() if info.address == proc.address]
    return name


def replica_stats(proc: ServerProcess) -> dict:
    with RolloutClient(proc.address, timeout=WAIT_S) as c:
        return c.stats()


def routed(router, name: str) -> dict[str, int]:
    return router.replicas()[name].routed
