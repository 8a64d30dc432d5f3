"""The trainer's side of vLLM's weight transfer, for trainers that do not import vLLM: the four
HTTP phases of vLLM's RL API to each engine, and the broadcasts in vLLM's layout between them.

    trainer = VllmWeightTrainer(["http://127.0.0.1:8000"], backend="gloo")
    trainer.init()      # hosts the group as rank 0; each engine's workers (/get_world_size) ranks after the last
    trainer.update(model.named_parameters(), weight_version="7")   # start, update_weights + broadcast, finish
    trainer.close()

An engine answers `/update_weights` only once it has received every broadcast, so that call runs
on a thread of its own while this thread broadcasts (`/init_weight_transfer_engine` likewise,
while the group forms). Any refusal raises `VllmPhaseError` with the engine's status and body;
the group stays usable after a refusal the engine answered (it drained the broadcasts), and is
made again by the next `init()` after a broadcast failed. Plain HTTP (`urllib`), no dependency.
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch

from weight_sync.transports import vllm_broadcast
from weight_sync.transports.distributed import WeightGroup
from weight_sync.vllm_layout import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    VLLM_GROUP,
    update_info,
)


class VllmPhaseError(RuntimeError):
    """An engine refused a phase: `status` and `body` are its answer (0: no answer)."""

    def __init__(self, phase: str, url: str, status: int, body: Any) -> None:
        super().__init__(f"{phase} at {url}: {status} {body}")
        self.phase, self.url, self.status, self.body = phase, url, status, body


class VllmWeightTrainer:
    """Rank 0 of a weight-update group with `len(engines)` vLLM-API engines (see module docstring).
    `master_port` 0 lets the OS pick; `timeout_s` bounds every collective and every HTTP call."""

    def __init__(self, engines: Sequence[str], *, master_address: str = "127.0.0.1", master_port: int = 0,
                 backend: str = "gloo", timeout_s: float = 60.0, api_key: Optional[str] = None,
                 trusted_network: bool = False, device: Optional[torch.device] = None) -> None:
        if not engines:
            raise ValueError("engines: at least one base URL")
        self.engines = [url.rstrip("/") for url in engines]
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.timeout_s, self.api_key, self.trusted_network, self.device = timeout_s, api_key, trusted_network, device
        self.group: Optional[WeightGroup] = None
        self._calls = concurrent.futures.ThreadPoolExecutor(len(self.engines), thread_name_prefix="vllm-phase")

    # ---- the phases ----------------------------------------------------------------------------

    def init(self) -> None:
        """Host the group and have every engine join it (`/init_weight_transfer_engine`)."""
        self.close_group()
        sizes = [self.world_size(url) for url in self.engines]
        offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]
        world = 1 + sum(sizes)
        group = WeightGroup.host(self.master_address, self.master_port, world_size=world, name=VLLM_GROUP,
                                 backend=self.backend, timeout_s=self.timeout_s, device=self.device,
                                 trusted_network=self.trusted_network)
        self.group = group
        calls = [self.post_async(url, "/init_weight_transfer_engine", {"init_info": {
            "master_address": self.master_address, "master_port": group.port, "rank_offset": offset,
            "world_size": world}}) for offset, url in zip(offsets, self.engines)]
        try:
            group.connect()
        finally:
            self._collect(calls)

    def update(self, named: Iterable[tuple[str, torch.Tensor]], *, packed: bool = True,
               buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES, num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
               weight_version: Optional[str] = None, calls: int = 1) -> int:
        """One update: start, the tensors in `calls` `/update_weights` calls (each its broadcasts),
        finish under `weight_version`; the bytes broadcast."""
        if self.group is None:
            raise RuntimeError("init() first")
        named = [(n, t.detach()) for n, t in named]
        self.each("/start_weight_update", {})
        sent = 0
        for part in _split(named, calls):
            sent += self.send(part, packed=packed, buffer_bytes=buffer_bytes, num_buffers=num_buffers)
        self.each("/finish_weight_update", {"weight_version": weight_version})
        return sent

    def send(self, named: Sequence[tuple[str, torch.Tensor]], *, packed: bool = True,
             buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
             num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> int:
        """One `/update_weights` call to every engine, with its broadcasts; the bytes broadcast."""
        body = {"update_info": update_info(named, packed=packed, buffer_bytes=buffer_bytes, num_buffers=num_buffers)}
        calls = [self.post_async(url, "/update_weights", body) for url in self.engines]
        try:
            return vllm_broadcast.send(self.group, [t for _, t in named], packed=packed, buffer_bytes=buffer_bytes,
                                       num_buffers=num_buffers)
        finally:
            self._collect(calls)

    def each(self, path: str, body: dict[str, Any]) -> None:
        self._collect([self.post_async(url, path, body) for url in self.engines])

    def post_async(self, url: str, path: str, body: dict[str, Any]) -> concurrent.futures.Future:
        """`post` on a thread of its own (a call the engine answers only once the broadcasts are in)."""
        return self._calls.submit(self.post, url, path, body)

    def world_size(self, url: str) -> int:
        """The workers behind one engine URL (`/get_world_size`: a router's replicas count each)."""
        return int(self.get(url, "/get_world_size")["world_size"])

    # ---- plumbing ------------------------------------------------------------------------------

    def get(self, url: str, path: str) -> Any:
        return self._open(url, path, urllib.request.Request(url + path, headers=self._headers(), method="GET"))

    def post(self, url: str, path: str, body: dict[str, Any]) -> Any:
        headers = {**self._headers(), "Content-Type": "application/json"}
        return self._open(url, path, urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                                            headers=headers, method="POST"))

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _open(self, url: str, path: str, request: urllib.request.Request) -> Any:
        try:
            # NOTE: twice the collectives' bound: an engine answers once its own bounded waits are over
            with urllib.request.urlopen(request, timeout=2 * self.timeout_s) as reply:
                return json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = raw.decode(errors="replace")
            raise VllmPhaseError(path, url, exc.code, answer) from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise VllmPhaseError(path, url, 0, str(exc)) from None

    def _collect(self, calls: list[concurrent.futures.Future]) -> None:
        """Wait for every call (each bounded by its own timeout), then raise the first failure."""
        failures = [c.exception() for c in calls]
        first = next((f for f in failures if f is not None), None)
        if first is not None:
            raise first

    def close_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def close(self) -> None:
        self.close_group()
        self._calls.shutdown(wait=False, cancel_futures=True)


def _split(named: list, calls: int) -> list[list]:
    """`named` in `calls` consecutive parts (vLLM's trainers may send a model in several calls)."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    size = -(-len(named) // calls) or 1
    return [named[i : i + size] for i in range(0, len(named), size)]


__all__ = ["VllmPhaseError", "VllmWeightTrainer"]
