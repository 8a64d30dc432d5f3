"""ReplicaSupervisor: keeps N replicas behind a router, replacing the ones that die.

A supervisor starts its replicas (`_start_one`: a child process, a Ray actor, ...), hands the
router their endpoints (`RolloutRouter.add_replica`), and watches them on a thread of its own:
one found dead (`_alive`) is removed from the router at once, so its owed requests fail over
without waiting for the router's own silence deadline, and a new one is started and added
(under a new name). Nothing but endpoint strings reaches the router.

`SpawnedReplicas` is the local kind: `rollout serve` children (`ServerProcess`), as
`rollout route --spawn N --model M` starts them. `rollout.router.ray.RayReplicas` places them
on a Ray cluster.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Union

from rollout.server.process import ServerProcess

logger = logging.getLogger(__name__)


class ReplicaSupervisor:
    """Base: `count` replicas behind `router`, checked every `check_every_s` (see module docstring).

    Invariant: `handles` maps each replica name the router knows from this supervisor to the
    handle that runs it; `replacements` counts the replicas started in place of dead ones.
    """

    def __init__(self, router: Any, count: int, *, check_every_s: float = 1.0, restart: bool = True) -> None:
        if count < 1:
            raise ValueError(f"{type(self).__name__}: count must be >= 1, got {count!r}")
        self.router = router
        self.count = count
        self.check_every_s = check_every_s
        self.restart = restart
        self.handles: dict[str, Any] = {}
        self.replacements = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- what a kind of replica provides -------------------------------------------------------

    def _start_one(self, index: int) -> tuple[Any, str]:
        """Start replica number `index`; (its handle, its endpoint `tcp://host:port`)."""
        raise NotImplementedError

    def _alive(self, handle: Any) -> bool:
        raise NotImplementedError

    def _stop_one(self, handle: Any) -> None:
        raise NotImplementedError

    # ---- life cycle ----------------------------------------------------------------------------

    def start(self) -> ReplicaSupervisor:
        """Start every replica (concurrently), add them to the router, then watch them."""
        with ThreadPoolExecutor(max_workers=self.count) as pool:
            started = list(pool.map(self._start_safely, range(self.count)))
        failed = [s for s in started if isinstance(s, BaseException)]
        if failed:
            for s in started:
                if not isinstance(s, BaseException):
                    self._stop_one(s[0])
            raise failed[0]
        for handle, address in started:
            self.handles[self.router.add_replica(address)] = handle
        self._thread = threading.Thread(target=self._watch, name=f"{type(self).__name__}-watch", daemon=True)
        self._thread.start()
        return self

    def _start_safely(self, index: int) -> Union[tuple[Any, str], BaseException]:
        try:
            return self._start_one(index)
        except BaseException as exc:  # noqa: BLE001 (raised by start() after the others are stopped)
            return exc

    def stop(self) -> None:
        """Stop watching, take the replicas out of the router and stop them."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(self.check_every_s + 60.0)
        with self._lock:
            handles, self.handles = self.handles, {}
        for name, handle in handles.items():
            try:
                self.router.remove_replica(name)
            except Exception:  # noqa: BLE001 (the router may be gone already)
                pass
            self._stop_one(handle)

    def __enter__(self) -> ReplicaSupervisor:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _watch(self) -> None:
        index = self.count
        while not self._stopping.wait(self.check_every_s):
            for name, handle in list(self.handles.items()):
                if self._stopping.is_set() or self._alive(handle):
                    continue
                logger.warning("replica %s died: taking it out%s", name, ", starting another" if self.restart else "")
                self.router.remove_replica(name)
                with self._lock:
                    self.handles.pop(name, None)
                self._stop_one(handle)
                if not self.restart:
                    continue
                try:
                    new, address = self._start_one(index)
                except Exception:  # noqa: BLE001 (tried again at the next check)
                    logger.exception("starting a replacement for %s failed", name)
                    continue
                index += 1
                with self._lock:
                    if self._stopping.is_set():
                        self._stop_one(new)
                        return
                    self.handles[self.router.add_replica(address)] = new
                    self.replacements += 1


class SpawnedReplicas(ReplicaSupervisor):
    """`count` `rollout serve --model MODEL [serve_args]` children on loopback ports the OS picks.

    `token`: the children's shared secret, handed over in their environment (`ROLLOUT_TOKEN`), never
    on their command lines, which every local user can read (`/proc/PID/cmdline`, `ps`).
    """

    def __init__(self, router: Any, model: Union[str, Path], count: int, serve_args: Sequence[str] = (), *,
                 entry: Sequence[str] = ("-m", "rollout.cli", "serve"), ready_timeout: float = 300.0,
                 token: Optional[str] = None, **options: Any) -> None:
        super().__init__(router, count, **options)
        self.model, self.serve_args, self.entry, self.ready_timeout = str(model), list(serve_args), entry, ready_timeout
        self.env = None if token is None else dict(os.environ, ROLLOUT_TOKEN=token)

    def _start_one(self, index: int) -> tuple[ServerProcess, str]:
        proc = ServerProcess(self.model, *self.serve_args, entry=self.entry, ready_timeout=self.ready_timeout,
                             env=self.env)
        return proc, proc.address

    def _alive(self, handle: ServerProcess) -> bool:
        return handle.alive()

    def _stop_one(self, handle: ServerProcess) -> None:
        handle.stop(grace_s=5.0)
