"""The engine of a server that serves HTTP only (`rollout serve --no-zmq`, `rollout vllm-serve`'s
default): its loop and weight receiver, as `RolloutServer` holds them, with no socket bound.
Frameworks start several servers per node; each binds the HTTP port it is given and nothing else."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from weight_sync import DiskAccess, Staging, WeightReceiver

LORA_LOAD_TIMEOUT_S = 300.0  # an adapter read from disk at start (a large one on a slow disk)


@dataclass(frozen=True, slots=True)
class HttpOnlyConfig:
    """What the in-process client reads of a server's config (`RolloutServer.config`'s fields)."""

    health_deadline_s: float


class HttpOnlyServer:
    """`engine`'s loop started and its `receiver`; `serve_forever()` waits until `stop()` (safe
    from a signal handler), then stops both."""

    def __init__(self, engine: Any, *, health_deadline_s: float, weight_staging: Staging,
                 weight_sync_timeout_s: float, disk_access: DiskAccess) -> None:
        self.engine = engine
        self.config = HttpOnlyConfig(health_deadline_s)
        self._stopped = threading.Event()
        engine.start()
        self.receiver = WeightReceiver(engine, staging=weight_staging, timeout_s=weight_sync_timeout_s,
                                       disk_access=disk_access)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()

    def serve_forever(self) -> None:
        while not self._stopped.wait(0.5):  # NOTE: a timed wait, so a signal's handler runs promptly
            pass
        self.close()

    def close(self) -> None:
        self._stopped.set()
        self.receiver.close()
        self.engine.stop()


def load_lora_modules(receiver: WeightReceiver, specs: list[str]) -> dict[str, str]:
    """`--lora-modules NAME=PATH ...` loaded through `receiver` (its path checks), one by one: name ->
    path. Raises ValueError naming the module that failed, with the engine's reason."""
    loaded: dict[str, str] = {}
    for spec in specs:
        name, eq, path = spec.partition("=")
        if not (name and eq and path):
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
        if name in loaded:
            raise ValueError(f"--lora-modules: {name!r} given twice")
        try:
            receiver.load_lora(name, path).result(timeout=LORA_LOAD_TIMEOUT_S)
        except Exception as exc:  # NOTE: the engine's reason (missing files, rank past --max-lora-rank, ...)
            raise ValueError(f"--lora-modules {spec}: {exc}") from exc
        loaded[name] = path
    return loaded
