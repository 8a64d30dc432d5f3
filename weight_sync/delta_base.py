"""What a sender last sent its replicas: the base its next delta is computed from.

Invariant: `tensors` are bitwise what every replica of the sender committed under `version` (the
replica dtype, on host), and nothing else holds them. A `WeightSender` in delta mode keeps one
(its replicas are one weight group: they all get the same updates), so its memory cost is one
copy of the model in the replica dtype (2 bytes a parameter in bf16), beside the trainer's own
weights. It is dropped whenever a sync fails (the next one is full) and replaced after each sync
that committed everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SentWeights:
    version: int
    names: list[str]
    tensors: list[torch.Tensor]

    @classmethod
    def keep(cls, named: Sequence[tuple[str, torch.Tensor]], version: int, owned: Sequence[bool]) -> SentWeights:
        """The base after a sync of `named` under `version`; `owned[i]`: tensor i is already a
        copy of the sender's own (a cast made it), so it is kept as is, not copied again."""
        tensors = [t if own else t.detach().to("cpu", copy=True) for (_, t), own in zip(named, owned)]
        return cls(version, [n for n, _ in named], tensors)

    def fits(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether `named` are the same tensors (names, dtypes, shapes, order) as the base's."""
        return len(named) == len(self.names) and all(
            n == m and t.dtype == b.dtype and t.shape == b.shape
            for (n, t), m, b in zip(named, self.names, self.tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


__all__ = ["SentWeights"]
