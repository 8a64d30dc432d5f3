"""Per-request state in fixed-size slots (e.g. a Mamba layer's conv and SSM state).

Unlike KV, recurrent state is not paged: a request's whole history is summed up in one slot per
state kind. Every kind of state the model declares (`StateSpec`) gets one tensor
`[num_slots, *shape]`; a slot index is valid in all of them at once, so a request holds one index.
The last slot is a scratch slot that padded batch rows may write into; it is never handed out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference.cache.memory import returnable_zeros
from inference.cache.specs import StateSpec


class StatePool:
    """Slots of per-request state for every declared `StateSpec`, with a free list.

    Invariants: a slot is free or held, never both; the scratch slot (`scratch`) is neither;
    a slot handed out by `allocate` reads as zeros until written. While deallocated (suspend)
    the bookkeeping stays as it is and `tensors` is unavailable.
    """

    def __init__(self, specs: Sequence[StateSpec], num_slots: int, device: torch.device, *,
                 allocate: bool = True) -> None:
        if not specs:
            raise ValueError("StatePool needs at least one StateSpec")
        if num_slots < 1:
            raise ValueError(f"StatePool.num_slots must be >= 1, got {num_slots}")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"StatePool: state names must be distinct, got {names}")
        self.specs = {s.name: s for s in specs}
        self.num_slots = num_slots
        self.scratch = num_slots  # one extra row per tensor
        self.device = torch.device(device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._tensors: dict[str, torch.Tensor] | None = None
        if allocate:
            self.allocate()

    # ---- slots -------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def held(self) -> int:
        return self.num_slots - len(self._free)

    def allocate_slot(self, *, zero: bool = True) -> int | None:
        """A zeroed slot (`zero=False`: as it was, for a caller that overwrites it), or None when
        every slot is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        if zero and self._tensors is not None:
            for t in self._tensors.values():
                t[slot].zero_()
        return slot

    def free_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"StatePool.free_slot: slot {slot} is not held")
        self._free.append(slot)

    def copy(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole slots `src[i] -> dst[i]` in every state tensor (a fork of a group sample)."""
        if not src:
            return
        s = torch.tensor(list(src), dtype=torch.int64, device=self.device)
        d = torch.tensor(list(dst), dtype=torch.int64, device=self.device)
        for t in self.tensors.values():
            t.index_copy_(0, d, t.index_select(0, s))

    # ---- memory ------------------------------------------------------------------------------

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """`name -> [num_slots + 1, *shape]` (the last row is the scratch slot)."""
        if self._tensors is None:
            raise RuntimeError("StatePool is not allocated (suspended?); call allocate() first")
        return self._tensors

    @property
    def is_allocated(self) -> bool:
        return self._tensors is not None

    @property
    def nbytes(self) -> int:
        return (self.num_slots + 1) * sum(s.bytes_per_slot for s in self.specs.values())

    def allocate(self) -> None:
        if self._tensors is None:
            self._tensors = {name: returnable_zeros((self.num_slots + 1, *s.shape), s.dtype, self.device)
                             for name, s in self.specs.items()}

    def deallocate(self) -> None:
        self._tensors = None

    def offload(self, slots: Sequence[int]) -> dict[str, torch.Tensor]:
        """Host copies of the given slots, in that order (suspend OFFLOAD)."""
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        return {name: t.index_select(0, index).to("cpu", copy=True) for name, t in self.tensors.items()}

    def restore(self, slots: Sequence[int], host: dict[str, torch.Tensor]) -> None:
        """Write an `offload()` result back into `slots`."""
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        for name, t in self.tensors.items():
            t.index_copy_(0, index, host[name].to(self.device))
