"""Ray placement: engine replicas as Ray actors, each in a placement group of its own.

    import ray
    from rollout import RolloutRouter
    from rollout.router.ray import RayReplicas, ReplicaResources

    ray.init()                                        # or ray.init(address="auto") on a cluster
    with RolloutRouter() as router, RayReplicas(router, "/ckpt/hf-dir", 4, ["--threads", "8"],
                                                resources=ReplicaResources(num_cpus=8)):
        client = RolloutClient(router.address)        # requests go to the router, never through Ray

Each replica is a `ReplicaActor` (a `RolloutServer` on its own thread in the actor's process),
scheduled into a placement group with one bundle of the replica's resources (`ReplicaResources`,
by default from its `--threads`), so a replica's CPUs (or GPU) are reserved together on one node.
Ray carries only small configuration in (the model path and `rollout serve` arguments, as
strings) and the replica's ZMQ endpoint out, as a string: requests and outputs travel over ZMQ
between router and replicas, never through Ray's object store, and nothing is pickled on the
data path. `RayReplicas` (a `ReplicaSupervisor`) hands the endpoints to the router and pings each
actor every `check_every_s`; an actor that died (or does not answer within `call_timeout_s`) is
taken out of the router at once and replaced by a new actor in a new placement group.

Every Ray call is bounded by a timeout. `ray` is an optional extra (`pip install
rollout-engine[ray]`); importing this module without it raises an ImportError that says so.

On a cluster, replicas must be reachable from the router: give `host="0.0.0.0"` and a `token`
(the replicas refuse to listen beyond loopback without credentials); the router then needs
`RouterConfig(replica_security=ClientSecurity(token=...))`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover (exercised where ray is absent)
    raise ImportError("rollout.router.ray needs Ray: pip install 'rollout-engine[ray]' (or ray)") from exc

from rollout.router.supervisor import ReplicaSupervisor

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplicaResources:
    """What one replica reserves: its placement group's single bundle (and the actor's request)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_cpus <= 0 or self.num_gpus < 0:
            raise ValueError(f"ReplicaResources: num_cpus must be > 0 and num_gpus >= 0, got {self}")

    @classmethod
    def from_serve_args(cls, serve_args: Sequence[str], num_gpus: float = 0.0) -> ReplicaResources:
        """One CPU per torch thread the replica runs (`--threads N`; 1 if not given)."""
        args = list(serve_args)
        threads = int(args[args.index("--threads") + 1]) if "--threads" in args else 1
        return cls(num_cpus=float(threads), num_gpus=num_gpus)

    def bundle(self) -> dict[str, float]:
        out = {"CPU": self.num_cpus}
        if self.num_gpus:
            out["GPU"] = self.num_gpus
        if self.memory_bytes:
            out["memory"] = float(self.memory_bytes)
        return out


class ReplicaActor:
    """One engine replica inside a Ray actor: `rollout serve` in process, on a thread of its own.

    Takes and returns only strings (see module docstring).
    """

    def __init__(self, model: str, serve_args: list[str], host: str = "127.0.0.1") -> None:
        import argparse

        from rollout.server.serve import add_serve_arguments, build_server

        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        args = parser.parse_args(["--model", model, "--host", host, "--port", "0", *serve_args])
        self.server = build_server(args).start()
        address = self.server.address
        if host in ("0.0.0.0", "::", "*"):  # NOTE: the wildcard is not an address the router can reach
            address = address.replace(host if host != "::" else "[::]", ray.util.get_node_ip_address(), 1)
        self.address = address

    def endpoint(self) -> str:
        return self.address

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.server.stop()


class RayReplicas(ReplicaSupervisor):
    """`count` replicas of `model` as Ray actors behind `router` (see module docstring).

    `serve_args` are `rollout serve` arguments for each (engine size, threads, token ...);
    `resources` default to one CPU per `--threads`. Call `ray.init()` first.
    """

    def __init__(self, router: Any, model: Union[str, Path], count: int, serve_args: Sequence[str] = (), *,
                 resources: Optional[ReplicaResources] = None, host: str = "127.0.0.1",
                 call_timeout_s: float = 30.0, ready_timeout_s: float = 300.0, **options: Any) -> None:
        options.setdefault("check_every_s", 1.0)
        super().__init__(router, count, **options)
        self.model, self.serve_args, self.host = str(model), [str(a) for a in serve_args], host
        self.resources = resources or ReplicaResources.from_serve_args(self.serve_args)
        self.call_timeout_s, self.ready_timeout_s = call_timeout_s, ready_timeout_s
        self._actor_class = ray.remote(ReplicaActor)

    def _start_one(self, index: int) -> tuple[tuple[Any, Any], str]:
        res = self.resources
        group = placement_group([res.bundle()], strategy="STRICT_PACK", name=f"rollout-replica-{index}-{id(self)}")
        try:
            ray.get(group.ready(), timeout=self.ready_timeout_s)
            actor = self._actor_class.options(
                num_cpus=res.num_cpus, num_gpus=res.num_gpus, memory=res.memory_bytes, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
            ).remote(self.model, self.serve_args, self.host)
            try:
                address = ray.get(actor.endpoint.remote(), timeout=self.ready_timeout_s)
            except BaseException:
                ray.kill(actor)
                raise
        except BaseException:
            remove_placement_group(group)
            raise
        logger.info("replica actor %d serves at %s", index, address)
        return (actor, group), str(address)

    def _alive(self, handle: tuple[Any, Any]) -> bool:
        actor, _ = handle
        try:
            return bool(ray.get(actor.ping.remote(), timeout=self.call_timeout_s))
        except (RayActorError, GetTimeoutError):
            return False

    def _stop_one(self, handle: tuple[Any, Any]) -> None:
        actor, group = handle
        try:
            ray.get(actor.shutdown.remote(), timeout=min(10.0, self.call_timeout_s))
        except Exception:  # noqa: BLE001 (dead already, or stuck: killed below)
            pass
        ray.kill(actor)
        remove_placement_group(group)

    def endpoints(self) -> list[str]:
        """The replicas' ZMQ endpoints now (for a router in another process: `rollout route --replicas`)."""
        handles = list(self.handles.values())
        return [str(a) for a in ray.get([h[0].endpoint.remote() for h in handles], timeout=self.call_timeout_s)]
