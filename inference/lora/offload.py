"""Adapters asleep with the weights: the engine's own LoRA tensors moved to host while the engine's
`weights` part is suspended (vLLM's sleep levels 1 and 2), and back on resume.

An adapter is weights the engine holds like the base model's, so a suspend that frees the weights
frees the adapters too. They go to host memory at both levels, never dropped: the trainer's next
sync after a level-2 sleep is the base model's, and an RL run re-sends an adapter only when it
changes (vLLM keeps adapters in a CPU cache across its sleep for the same reason). A shared
adapter (`load_lora_from_peft(..., share=True)`) is the trainer's own parameters: it stays where it
is, as the base weights a trainer aliases do.

The unit is a tensor's storage (its bytes, whatever views read them): the storage is emptied in
place (`resize_(0)`), so every view the forward holds (stacked A, B^T) sees the bytes again after
`restore`, and nothing is rebuilt.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from inference.lora.adapter import LoRAAdapter


def _tensors(adapter: LoRAAdapter) -> Iterator[torch.Tensor]:
    for layer in adapter.layers:
        for a, b in layer.values():
            yield a
            yield b
    for layer in adapter.fused:
        for blocks in layer.values():
            for a, _, parts in blocks:
                yield a
                yield from (bt for *_, bt in parts)


class AdapterOffload:
    """The adapters' storages away on host (`offload`) until `restore`. One writer: the engine core."""

    __slots__ = ("_away",)

    def __init__(self) -> None:
        self._away: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []  # (engine's, host copy)

    @property
    def nbytes(self) -> int:
        return sum(host.nbytes() for _, host in self._away)

    def offload(self, adapters: Iterable[LoRAAdapter]) -> int:
        """Move every engine-owned adapter storage to host; the bytes moved (0 when already away)."""
        if self._away:
            return 0
        seen: set[int] = set()
        for adapter in adapters:
            if adapter.shared:
                continue
            for t in _tensors(adapter):
                storage = t.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                host = torch.UntypedStorage(storage.nbytes(), device="cpu")
                host.copy_(storage)  # NOTE: a real copy out, on a CPU device too
                storage.resize_(0)
                self._away.append((storage, host))
        return self.nbytes

    def restore(self) -> None:
        """Bring every storage back (all or, on an allocation failure, none: the ones done so far
        are emptied again and the error propagates)."""
        done: list[torch.UntypedStorage] = []
        try:
            for storage, host in self._away:
                storage.resize_(host.nbytes())
                storage.copy_(host)
                done.append(storage)
        except BaseException:
            for storage in done:
                storage.resize_(0)
            raise
        self._away = []
