"""The resident LoRA adapters: by name, by version, pinned by the requests that use them.

Loading a name again makes a new version current; requests already running stay pinned to the
version they were added under (PIN) and finish on it, and a version no longer current is freed
when its last request ends. The prefix cache keys blocks by (name, version), so a reload never
serves a block computed under the old version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from inference.errors import LoRACapacityError, LoRAInUseError, LoRALoadError, LoRANotFoundError
from inference.lora.adapter import LoRAAdapter


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """What a request holds: the adapter's name, its version, and its resident id (never reused)."""

    name: str
    version: int
    id: int


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    version: int
    rank: int
    path: Optional[str]
    nbytes: int
    requests: int  # requests in flight pinned to this version


class LoRARegistry:
    """Invariants: at most `max_loras` names are current; at most `max_staleness + 1` versions of
    one name are resident (the current one and those requests in flight still use); a resident id
    is current or pinned by at least one request; ids only grow, so a stale id never names another
    adapter. A shared adapter (aliasing a trainer's tensors) gets its next version only while no
    request is pinned to the current one, since both would read the same memory."""

    def __init__(self, max_loras: int, max_lora_rank: int, max_staleness: int = 1) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_staleness = max_staleness
        self._resident: dict[int, LoRAAdapter] = {}
        self._current: dict[str, int] = {}  # name -> id of its current version
        self._pins: dict[int, int] = {}  # id -> requests pinned to it
        self._held: dict[int, int] = {}  # request id -> adapter id
        self._next_id = 0
        self.adapter_bytes = 0

    def __contains__(self, name: str) -> bool:
        return name in self._current

    def __len__(self) -> int:
        return len(self._current)

    @property
    def resident_versions(self) -> int:
        return len(self._resident)

    def add(self, adapter: LoRAAdapter, version: Optional[int] = None) -> AdapterRef:
        """Make `adapter` the current version of its name (a new name, or the next version);
        `version` (a trainer's sync names it) must be newer than the current one."""
        old = self._current.get(adapter.name)
        latest = 0 if old is None else self._resident[old].version
        if version is not None and version <= latest:
            raise LoRALoadError(f"LoRA adapter {adapter.name!r}: version {version} is not newer than the loaded "
                                f"version {latest}")
        if old is None and len(self._current) >= self.max_loras:
            raise LoRACapacityError(f"cannot load LoRA adapter {adapter.name!r}: max_loras={self.max_loras} adapters "
                                    f"are loaded ({sorted(self._current)}); unload one first")
        if adapter.rank > self.max_lora_rank:
            raise LoRACapacityError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} exceeds "
                                    f"max_lora_rank={self.max_lora_rank}")
        if old is not None and self._pins[old] and (adapter.shared or self._resident[old].shared):
            # NOTE: versions of a shared adapter read the same (the trainer's) tensors: PIN cannot hold
            raise LoRAInUseError(f"cannot load version {self._resident[old].version + 1} of LoRA adapter "
                                 f"{adapter.name!r}: {self._pins[old]} requests use the current one, whose tensors "
                                 "are shared with the trainer; step the trainer and load the next version once "
                                 "they finished (colocated: while the engine is suspended)")
        versions = sum(1 for a in self._resident.values() if a.name == adapter.name)
        if old is not None and self._pins[old] and versions >= self.max_staleness + 1:
            raise LoRACapacityError(f"cannot load version {self._resident[old].version + 1} of LoRA adapter "
                                    f"{adapter.name!r}: {versions} versions are resident and requests still use the "
                                    f"current one (max_staleness={self.max_staleness}); retry once the oldest "
                                    "version's requests finished, or abort them")
        adapter.version = latest + 1 if version is None else version
        new = self._next_id
        self._next_id += 1
        self._resident[new] = adapter
        self._pins[new] = 0
        self.adapter_bytes += adapter.nbytes
        self._current[adapter.name] = new
        if old is not None:
            self._free_if_unused(old)
        return AdapterRef(adapter.name, adapter.version, new)

    def remove(self, name: str) -> None:
        """Unload `name`; refused (`LoRAInUseError`) while requests are pinned to any of its versions."""
        if name not in self._current:
            raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded")
        busy = sum(n for i, n in self._pins.items() if self._resident[i].name == name)
        if busy:
            raise LoRAInUseError(f"LoRA adapter {name!r} is used by {busy} requests in flight; unload it once "
                                 "they finished (or abort them)")
        self._free_if_unused(self._current.pop(name))

    def pin(self, name: str, request_id: int) -> AdapterRef:
        """Pin request `request_id` to the current version of `name` until `release(request_id)`."""
        ident = self._current.get(name)
        if ident is None:
            raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self._current)})")
        self._pins[ident] += 1
        self._held[request_id] = ident
        adapter = self._resident[ident]
        return AdapterRef(name, adapter.version, ident)

    def release(self, request_id: int) -> None:
        """Request `request_id` ended: drop its pin (a no-op for a request without an adapter)."""
        ident = self._held.pop(request_id, None)
        if ident is not None:
            self._pins[ident] -= 1
            self._free_if_unused(ident)

    def resident(self) -> list[LoRAAdapter]:
        """Every resident version (current ones and those kept for requests pinned to them)."""
        return list(self._resident.values())

    def adapter(self, ident: int) -> LoRAAdapter:
        return self._resident[ident]

    def current(self, name: str) -> AdapterRef:
        ident = self._current.get(name)
        if ident is None:
            raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded")
        return AdapterRef(name, self._resident[ident].version, ident)

    def infos(self) -> list[AdapterInfo]:
        """The current version of every loaded adapter, by name."""
        out = []
        for name, ident in sorted(self._current.items()):
            a = self._resident[ident]
            out.append(AdapterInfo(name, a.version, a.rank, a.path, a.nbytes, self._pins[ident]))
        return out

    def _free_if_unused(self, ident: int) -> None:
        adapter = self._resident[ident]
        if self._pins[ident] == 0 and self._current.get(adapter.name) != ident:
            del self._resident[ident], self._pins[ident]
            self.adapter_bytes -= adapter.nbytes
