"""What the peers' launch lines share (`vllm_serve.py`, `sglang_serve.py`): their flags' spellings,
the refusals every line gets, and the `rollout serve` arguments a translated line becomes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

# the peers' dtype names -> `rollout serve`'s
DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
          "float": "float32"}


class LaunchLineError(ValueError):
    """A flag of the launch line this server cannot honour, with the reason."""


def normalized(argv: list[str]) -> list[str]:
    """Flags in their dashed spelling: `--max-num_batched_tokens=8` -> `--max-num-batched-tokens=8`."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def check_model(model: str, flag: str, holds: str = "config.json", named: bool = True) -> None:
    """A local HF directory (holding `holds`) or (`named`) `smollm2`: there is no model hub to fetch an
    id from."""
    if not (named and model == "smollm2") and not (Path(model) / holds).is_file():
        nor = "nor `smollm2`; " if named else ""
        raise LaunchLineError(f"{flag}{model}: not a local HF model directory (no {holds}), {nor}there "
                              "is no model hub here: download it first (e.g. `huggingface-cli download ID "
                              "--local-dir DIR`) and pass DIR")


def check_host(host: str, api_key: str | None, key_env: str) -> None:
    from rollout.wire.security import is_loopback

    if not is_loopback(host) and not api_key:
        raise LaunchLineError(f"--host {host} without --api-key: beyond loopback every client must present a key "
                              f"here; add --api-key KEY (or set ${key_env})")


def check_one(flag: str, value: int, instead: str) -> None:
    """A parallel size this one engine process can honour: 1."""
    if value != 1:
        raise LaunchLineError(f"{flag} {value}: one engine process serves here ({instead})")


def kv_bytes(fraction: float, flag: str, free_bytes: int | None) -> int:
    """The KV pool for a memory fraction flag: that fraction of the memory free at start."""
    if not 0.0 < fraction <= 1.0:
        raise LaunchLineError(f"{flag} {fraction}: a fraction in (0, 1]")
    from rollout.server.serve import free_memory_bytes

    free = free_bytes if free_bytes is not None else free_memory_bytes()
    if free is None:
        raise LaunchLineError("this machine does not say how much memory is free: give the KV pool's size instead")
    return max(1, int(free * fraction))


def serve_namespace(line: list[str], flags: dict[str, object],
                    repeated: dict[str, list[str]] | None = None) -> argparse.Namespace:
    """`rollout serve`'s arguments: `line`, then each flag of `flags` whose value is not None (a list:
    several values; True: a switch), then each flag of `repeated` once per value."""
    from rollout.server.serve import add_serve_arguments

    line = list(line)
    for flag, value in flags.items():
        if value is True:
            line.append(flag)
        elif isinstance(value, list):
            line += [flag, *map(str, value)]
        elif value is not None and value is not False:
            line += [flag, str(value)]
    for flag, values in (repeated or {}).items():
        for value in values:
            line += [flag, value]
    base = argparse.ArgumentParser()
    add_serve_arguments(base)
    return base.parse_args(line)


def add_own_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of this server's own beside a peer's (`--device` as both peers spell it)."""
    parser.add_argument("--device", default="cpu", help="where the engine runs: cpu (default), cuda, ...")
    ours = parser.add_argument_group("this server's own")
    ours.add_argument("--rollout-zmq-port", type=int,
                      help="also serve the engine's ZMQ protocol on this loopback port (0: one the OS chooses, "
                      "printed); without it only the HTTP port is bound")
    ours.add_argument("--threads", type=int, help="torch threads (default: torch's)")


def run(command: str, to_serve_args: Callable[[list[str]], argparse.Namespace], argv: list[str]) -> int:
    """Serve the line `argv` translated by `to_serve_args`; a refused flag exits 2 with its reason."""
    try:
        args = to_serve_args(argv)
    except LaunchLineError as exc:
        print(f"rollout {command}: {exc}", file=sys.stderr, flush=True)
        return 2
    from rollout.server.serve import serve_main

    return serve_main(args)
