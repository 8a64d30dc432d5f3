"""`rollout route`: a router process in front of engine replicas (the process side of `rollout.router.router`).

    rollout route --replicas tcp://127.0.0.1:5555,tcp://127.0.0.1:5556 --port 5600
    rollout route --spawn 2 --model /ckpt/hf-dir --port 5600 -- --threads 1 --block-size 16

With `--replicas` it routes to servers started elsewhere (taken out while down, back once
healthy); with `--spawn N --model M` it starts N `rollout serve` children itself (arguments after
`--` go to each) and replaces one that dies. Clients connect to it as to a server. Once its
replicas are up (or `--ready-timeout-s` passed: requests wait for one) it prints one line,
`rollout route: listening on tcp://HOST:PORT (K of N replicas up ...)`, and routes until SIGTERM
or SIGINT.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Optional

from rollout.server.process import ServerProcess
from rollout.wire.security import InsecureBindError, ServerSecurity, check_bind

READY_PREFIX = "rollout route: listening on "


class RouterProcess(ServerProcess):
    """`rollout route --port PORT [args]` as a child process, stopped on exit, e.g.
    `RouterProcess("--replicas", "tcp://...,tcp://...")` or
    `RouterProcess("--spawn", "2", "--model", DIR, "--", "--threads", "1")`; `address` is its endpoint."""

    def __init__(self, *args: str, host: str = "127.0.0.1", port: int = 0, ready_timeout: float = 300.0,
                 env: Optional[dict[str, str]] = None) -> None:
        super().__init__(None, *args, host=host, port=port, ready_timeout=ready_timeout, env=env,
                         entry=("-m", "rollout.cli", "route"), ready_prefix=READY_PREFIX)


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("replicas (one of)")
    src.add_argument("--replicas", help="comma-separated replica addresses, e.g. tcp://127.0.0.1:5555,...")
    src.add_argument("--spawn", type=int, help="start this many `rollout serve` children (needs --model)")
    src.add_argument("--model", help="the spawned replicas' model (an HF directory, or `smollm2`)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; any other "
                        "needs --token or --curve-keys)")
    parser.add_argument("--port", type=int, default=5600, help="TCP port (0: one the OS chooses, printed)")
    auth = parser.add_argument_group("credentials (required beyond loopback)")
    auth.add_argument("--token", default=os.environ.get("ROLLOUT_TOKEN"),
                      help="shared secret clients must present, also presented to the replicas (default "
                      "$ROLLOUT_TOKEN)")
    auth.add_argument("--curve-keys", help="the router's CURVE certificate with its secret key")
    auth.add_argument("--curve-clients", help="directory of accepted client CURVE public keys")
    rt = parser.add_argument_group("routing")
    rt.add_argument("--lease-s", type=float, default=10.0, help="abort a silent client's requests after this")
    rt.add_argument("--max-lease-s", type=float, default=60.0,
                    help="the longest lease a client may ask for (longer ones are cut to this)")
    rt.add_argument("--retain-s", type=float, default=120.0, help="keep finished requests for resubmitting clients")
    rt.add_argument("--health-every-s", type=float, default=0.25, help="poll each replica's health this often")
    rt.add_argument("--dead-after-s", type=float, default=3.0, help="a replica silent this long is taken out")
    rt.add_argument("--stall-deadline-s", type=float, default=5.0,
                    help="a replica whose engine loop has not gone round for this long is taken out")
    rt.add_argument("--max-seq-len", type=int,
                    help="refuse (CONTEXT_OVERFLOW) a Generate whose prompt + max_tokens is longer, before any "
                    "replica sees it (default: with --spawn the children's --max-seq-len, else 131072)")
    rt.add_argument("--max-staleness", type=int, help="policy versions a partial rollout may span, minus one "
                    "(default: no bound)")
    rt.add_argument("--stale-policy", choices=["recompute", "abort"], default="recompute",
                    help="what happens to a sample past --max-staleness")
    rt.add_argument("--ready-timeout-s", type=float, default=60.0,
                    help="wait this long for the replicas to answer healthy before saying it listens")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="after `--`: arguments for each spawned `rollout serve`")


def router_config(args: argparse.Namespace, serve_args: Sequence[str] = ()):
    """The router's config from its arguments (`serve_args`: what each spawned child gets)."""
    from pathlib import Path

    from rollout.router.links import HealthConfig
    from rollout.router.router import DEFAULT_MAX_SEQUENCE_LENGTH, RouterConfig
    from rollout.wire.security import ClientSecurity

    security = ServerSecurity(token=args.token or None, curve_keys=Path(args.curve_keys) if args.curve_keys else None,
                              curve_clients=Path(args.curve_clients) if args.curve_clients else None)
    return RouterConfig(host=args.host, port=args.port, lease_s=args.lease_s, max_lease_s=args.max_lease_s,
                        retain_s=args.retain_s,
                        security=security, replica_security=ClientSecurity(token=args.token) if args.token else None,
                        health=HealthConfig(every_s=args.health_every_s, dead_after_s=args.dead_after_s,
                                            stall_deadline_s=args.stall_deadline_s),
                        max_staleness=args.max_staleness, stale_policy=args.stale_policy,
                        max_sequence_length=args.max_seq_len or (_spawned_max_seq_len(args.model, serve_args)
                                                                 if args.spawn else DEFAULT_MAX_SEQUENCE_LENGTH))


def _spawned_max_seq_len(model: str, serve_args: Sequence[str]) -> int:
    """The --max-seq-len the spawned children run with: their arguments as `rollout serve` reads them."""
    from rollout.server.serve import add_serve_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    known, _ = parser.parse_known_args(["--model", model, *serve_args])
    return known.max_seq_len


def route_main(args: argparse.Namespace) -> int:
    """Route until SIGTERM / SIGINT."""
    from rollout.router.router import RolloutRouter
    from rollout.router.supervisor import SpawnedReplicas

    serve_args = [a for a in (args.serve_args or []) if a != "--"] if args.serve_args else []
    if bool(args.replicas) == bool(args.spawn) or (args.spawn and not args.model):
        print("rollout route: give --replicas ADDR,... or --spawn N --model M", file=sys.stderr, flush=True)
        return 2
    try:
        config = router_config(args, serve_args)
        check_bind(args.host, config.security)
    except (InsecureBindError, ValueError) as exc:
        print(f"rollout route: {exc}", file=sys.stderr, flush=True)
        return 2
    addresses = [a.strip() for a in args.replicas.split(",") if a.strip()] if args.replicas else []
    router = RolloutRouter(addresses, config)
    signal.signal(signal.SIGTERM, lambda *_: router.stop())
    signal.signal(signal.SIGINT, lambda *_: router.stop())
    router.start()
    spawned: Optional[SpawnedReplicas] = None
    try:
        if args.spawn:
            spawned = SpawnedReplicas(router, args.model, args.spawn, serve_args, token=args.token or None).start()
        count = len(addresses) or args.spawn
        up = router.wait_ready(count, args.ready_timeout_s)
        print(f"{READY_PREFIX}{router.address} ({up} of {count} replicas up{', spawned' if spawned else ''}, "
              f"pid {os.getpid()})", flush=True)
        while not router.wait(0.5):
            pass
    finally:
        if spawned is not None:
            spawned.stop()
        router.stop()
        router.close()
    print("rollout route: stopped", flush=True)
    return 0
