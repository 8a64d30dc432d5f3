"""ServerProcess: start `rollout serve` as a child process, wait until it listens, stop it.

    with ServerProcess("/ckpt/hf-dir", "--threads", "1") as server:
        client = RolloutClient(server.address)

The child runs this checkout's `rollout` package (its root goes first on PYTHONPATH) with
`OMP_WAIT_POLICY=PASSIVE` unless the environment sets it (spinning OpenMP threads starve the
other processes on a small machine). Its output is kept (the last lines, for error messages)
and never blocks it. `stop()` sends SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from rollout.server.serve import HTTP_READY_PREFIX, READY_PREFIX

_ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """A `rollout serve --model MODEL --port PORT [extra args]` child (see module docstring); port 0
    lets the OS choose, and `address` says which."""

    def __init__(self, model: Optional[os.PathLike | str], *args: str, host: str = "127.0.0.1", port: int = 0,
                 ready_timeout: float = 120.0, env: Optional[dict[str, str]] = None,
                 entry: Sequence[str] = ("-m", "rollout.cli", "serve"), ready_prefix: str = READY_PREFIX) -> None:
        """`entry`: what the child runs before its arguments (tests run `rollout serve` with hooks);
        `ready_prefix`: the start of the line it prints once it listens; no `--model` if `model` is None."""
        child_env = dict(os.environ if env is None else env)
        child_env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in [child_env.get("PYTHONPATH")] if p])
        child_env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        model_args = [] if model is None else ["--model", str(model)]
        self.command = [sys.executable, *entry, *model_args, "--host", host, "--port", str(port), *args]
        self.ready_prefix = ready_prefix
        self.output: collections.deque[str] = collections.deque(maxlen=200)
        self._ready = threading.Event()
        self.address: Optional[str] = None
        self.http_url: Optional[str] = None  # with `--http PORT`: the HTTP front's base URL
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=child_env, bufsize=1)
        self._reader = threading.Thread(target=self._read, name="rollout-serve-output", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + ready_timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._reader.join(1.0)
                self.stop()
                why = f"exited with {self.proc.returncode}" if self.proc.returncode is not None else \
                    f"did not listen within {ready_timeout} s"
                what = "rollout serve" if ready_prefix == READY_PREFIX else ready_prefix.split(":")[0]
                raise RuntimeError(f"{what} {why}:\n" + "\n".join(self.output))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.output.append(line)
            if line.startswith(HTTP_READY_PREFIX) and self.http_url is None:
                self.http_url = line[len(HTTP_READY_PREFIX):].split()[0]
            if line.startswith(self.ready_prefix) and not self._ready.is_set():
                self.address = re.match(rf"{re.escape(self.ready_prefix)}(\S+)", line).group(1)
                self._ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM, then SIGKILL after `grace_s`; the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
