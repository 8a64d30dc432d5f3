"""torch.distributed weight-update groups: the trainer broadcasts buckets to every replica.

A `WeightGroup` is one process's member of a group of its own, never the default process group
(a trainer keeps its data / tensor-parallel groups): rank 0 is the trainer, ranks 1.. the
replicas. Rank 0 hosts a TCPStore at `master_address:master_port` (port 0: one the OS picks,
`port` says which); every rank builds a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU)
object directly on it, with a timeout, so every collective fails after the timeout instead of
hanging (a dead peer shows as that timeout, or sooner as a closed connection). After a failure a
group is unusable: close it and create a new one, as frameworks do per sync when a replica joins
or leaves. A replica given no rank (`rank=None`, e.g. one init message broadcast by a router to
all replicas) claims the next free one from the store.

The store listens on `master_address` only (a socket bound here and handed to the TCPStore as
`master_listen_fd`; on its own the TCPStore listens on every interface). A TCPStore has no
authentication: anyone who reaches it can read and write its keys, claim a rank or join the group
and then see or feed the broadcast weights. So a non-loopback master is refused unless the caller
says the network is trusted (`trusted_network=True`: a private cluster network, or a tunnel); on
loopback every local process can still reach it, as with every loopback service here.

Moving an update over a group: `weight_sync.transports.bucket_broadcast`.
"""

from __future__ import annotations

import datetime
import enum
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist

from weight_sync.sources import DEFAULT_GROUP

logger = logging.getLogger(__name__)

PIPELINE_DEPTH = 2  # broadcasts in flight


class GroupError(RuntimeError):
    """A collective failed (a timeout, a peer gone): the group must be closed and made again."""


class RefusedError(RuntimeError):
    """Another rank said no at an `agree` step (it names why in its own reply)."""


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on `host:port` only (port 0: one the OS picks)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


class CollectiveBackend(str, enum.Enum):
    """The torch.distributed backend of a weight-update group (the value is torch's name)."""

    GLOO = "gloo"  # CPU tensors
    NCCL = "nccl"  # CUDA tensors, on the engine's GPU

    @classmethod
    def of(cls, value: CollectiveBackend | str) -> CollectiveBackend:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {value!r}") from None


class WeightGroup:
    """One rank of a weight-update group (see module docstring). `host()` on the trainer, then
    `connect()` once the replicas were told to join; `join()` on a replica (blocks until all
    ranks are in, at most `timeout_s`)."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, name: str, backend: CollectiveBackend | str,
                 timeout_s: float, master_address: str, device: Optional[torch.device] = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        backend = CollectiveBackend.of(backend)
        self.store, self.rank, self.world_size, self.name = store, rank, world_size, name
        self.backend, self.timeout_s, self.master_address = backend, timeout_s, master_address
        if backend is CollectiveBackend.GLOO:
            self.device = torch.device("cpu")
        else:  # NOTE: NCCL runs where its tensors are: the engine's GPU (a replica), else the current one
            device = torch.device(device) if device is not None else torch.device("cuda")
            self.device = torch.device("cuda", device.index if device.index is not None else
                                       torch.cuda.current_device())
        self.pg = None
        self.broken: Optional[str] = None

    @classmethod
    def host(cls, master_address: str = "127.0.0.1", master_port: int = 0, *, world_size: int,
             name: str = DEFAULT_GROUP, backend: CollectiveBackend | str = "gloo", timeout_s: float = 60.0,
             device: Optional[torch.device] = None, trusted_network: bool = False) -> WeightGroup:
        """Rank 0's store, listening on `master_address` only (port 0: the OS picks one, see
        `port`); `connect()` next. Beyond loopback only with `trusted_network` (module docstring)."""
        if not _is_loopback(master_address) and not trusted_network:
            raise ValueError(f"master_address {master_address!r} is beyond loopback: the weight-update group's "
                             "TCPStore has no authentication, so pass trusted_network=True only on a network "
                             "where every host may join the group")
        listener = _listen(master_address, master_port)
        try:
            store = dist.TCPStore(master_address, listener.getsockname()[1], world_size, True,
                                  timeout=_timeout(timeout_s), wait_for_workers=False,
                                  master_listen_fd=listener.fileno(), use_libuv=True)
        except BaseException:
            listener.close()
            raise
        listener.detach()  # NOTE: the store's server owns the descriptor now (libuv closes it with the store)
        return cls(store, rank=0, world_size=world_size, name=name, backend=backend, timeout_s=timeout_s,
                   master_address=master_address, device=device)

    @classmethod
    def join(cls, master_address: str, master_port: int, *, world_size: int, rank: Optional[int],
             name: str = DEFAULT_GROUP, backend: CollectiveBackend | str = "gloo", timeout_s: float = 60.0,
             device: Optional[torch.device] = None) -> WeightGroup:
        """A replica's rank (`rank` None: the next unclaimed one), connected to every other rank;
        `GroupError` if that takes more than `timeout_s` (plus a second's grace) whatever the peer does.

        NOTE: a TCPStore client waits for the store's first answer with no bound of its own, so a
        peer that accepts and stays silent (a frozen trainer, a wrong port) would hold the caller
        forever: the join runs on a thread of its own, and a late one is closed when it returns."""
        outcome: dict[str, Any] = {}
        lock = threading.Lock()

        def attempt() -> None:
            try:
                group = cls._join(master_address, master_port, world_size=world_size, rank=rank, name=name,
                                  backend=backend, timeout_s=timeout_s, device=device)
            except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread)
                group, error = None, exc
            else:
                error = None
            with lock:
                if outcome.get("abandoned"):
                    if group is not None:
                        group.close()
                    return
                outcome.update(group=group, error=error)

        thread = threading.Thread(target=attempt, name=f"weight-group-join-{name}", daemon=True)
        thread.start()
        thread.join(timeout_s + 1.0)
        with lock:
            if "group" not in outcome:
                outcome["abandoned"] = True
                raise GroupError(f"weight-update group {name!r}: no answer from {master_address}:{master_port} within "
                                 f"{timeout_s} s (a peer that accepts and stays silent, or not a weight-update group)")
        if outcome["error"] is not None:
            raise outcome["error"]
        return outcome["group"]

    @classmethod
    def _join(cls, master_address: str, master_port: int, *, world_size: int, rank: Optional[int], name: str,
              backend: CollectiveBackend | str, timeout_s: float, device: Optional[torch.device]) -> WeightGroup:
        try:
            store = dist.TCPStore(master_address, master_port, world_size, False, timeout=_timeout(timeout_s))
        except (RuntimeError, OSError) as exc:
            raise GroupError(f"cannot reach the weight-update group's store at {master_address}:{master_port}: "
                             f"{exc}") from exc
        if rank is None:
            rank = int(store.add(f"{name}/claimed_ranks", 1))  # NOTE: 1, 2, ... (rank 0 is the trainer)
        group = cls(store, rank=rank, world_size=world_size, name=name, backend=backend, timeout_s=timeout_s,
                    master_address=master_address, device=device)
        group.connect()
        return group

    @property
    def port(self) -> int:
        return self.store.port

    def connect(self) -> None:
        """Build the process group: returns once every rank has joined, else raises `GroupError`."""
        prefix = dist.PrefixStore(self.name, self.store)
        try:
            if self.backend is CollectiveBackend.GLOO:
                options = dist.ProcessGroupGloo._Options()
                options._timeout = _timeout(self.timeout_s)
                local = "127.0.0.1" if _is_loopback(self.master_address) else None
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=local) if local
                                    else dist.ProcessGroupGloo.create_default_device()]
                self.pg = dist.ProcessGroupGloo(prefix, self.rank, self.world_size, options)
            else:
                # NOTE: on a failed or timed-out collective NCCL's watchdog tears the whole process
                # down by default; a replica must outlive a dead trainer: abort the communicator only
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = _timeout(self.timeout_s)
                self.pg = dist.ProcessGroupNCCL(prefix, self.rank, self.world_size, options)
        except (RuntimeError, OSError) as exc:
            self.broken = f"joining failed: {exc}"
            raise GroupError(f"weight-update group {self.name!r}: rank {self.rank} of {self.world_size} could not "
                             f"join within {self.timeout_s} s: {exc}") from exc

    # ---- collectives ---------------------------------------------------------------------------

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(_timeout(self.timeout_s))
        except (RuntimeError, OSError) as exc:
            self.broken = f"{what} failed: {exc}"
            raise GroupError(f"weight-update group {self.name!r} (rank {self.rank}): {what} failed: {exc}") from exc

    def _check(self) -> None:
        if self.pg is None:
            raise GroupError(f"weight-update group {self.name!r} is not connected")
        if self.broken is not None:
            raise GroupError(f"weight-update group {self.name!r} is broken ({self.broken}); make it again")

    def broadcast_async(self, tensor: torch.Tensor):
        self._check()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.pg.broadcast([tensor], options)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._wait(self.broadcast_async(tensor), "a broadcast")

    def agree(self, ok: bool) -> bool:
        """Whether every rank said yes (all_reduce MIN of the verdicts)."""
        self._check()
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._wait(self.pg.allreduce([flag], options), "agreeing")
        return bool(flag.item())

    def pipeline(self, pieces: Iterable[torch.Tensor],
                 on_piece: Optional[Callable[[int, torch.Tensor], None]] = None, depth: int = PIPELINE_DEPTH) -> None:
        """Broadcast each of `pieces` (flat uint8 tensors, drawn one at a time) from rank 0,
        `depth` in flight; `on_piece(k, piece)` in order once piece `k` is complete (a
        receiver sums it while the next ones arrive), before piece `k + depth` is drawn."""
        pending: list[tuple[Any, int, torch.Tensor]] = []
        for k, piece in enumerate(pieces):
            pending.append((self.broadcast_async(piece), k, piece))
            if len(pending) >= depth:
                self._finish(pending.pop(0), on_piece)
        while pending:
            self._finish(pending.pop(0), on_piece)

    def _finish(self, item, on_piece) -> None:
        work, k, piece = item
        self._wait(work, "a bucket broadcast")
        if on_piece is not None:
            on_piece(k, piece)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        self.broken = self.broken or "closed"
        if pg is not None:
            for method in ("abort", "shutdown"):  # NOTE: NCCL needs one to free its communicator
                fn = getattr(pg, method, None)
                if fn is not None and self.backend is CollectiveBackend.NCCL:
                    try:
                        fn()
                        break
                    except RuntimeError:
                        continue


# ---- the two sides of one update -----------------------------------------------------------------


class ReceiveBuffer:
    """A receiver's reused bucket buffer (warm memory: no first-touch faults after the first sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buf: Optional[torch.Tensor] = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.buf
