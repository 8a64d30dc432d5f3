"""The paged KV buffer: one tensor for all layers, cut into fixed-size blocks.

Layout (see docs/INTERFACES.md): `data` is `[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]`, index 0 of dim 1 is K and 1 is V. Token `t` of a request lives at slot
`block_table[t // block_size] * block_size + t % block_size` of every layer. Each layer's K and V
are contiguous `[num_blocks, block_size, H, D]` pages, i.e. flashinfer's "NHD" paged layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference import native
from inference.cache.memory import returnable_zeros

IdList = Sequence[int] | torch.Tensor


class KVCacheBuffer:
    """Device memory for the K/V of every layer, addressed by block id and slot.

    Invariants:
    * While allocated, `data` has exactly the shape above and holds only finite values: it is
      zero-filled on allocation and only ever written with K/V rows. Attention backends rely on
      this, because padded block-table entries make them read blocks they then mask out, and a
      NaN there would survive the mask (0 * NaN = NaN).
    * `deallocate()` drops the only reference this object holds to the storage, so the memory
      can actually be returned (suspend); every view handed out before (`layer(i)`) keeps the old
      storage alive, so callers must not cache views across a suspend.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        allocate: bool = True,
        resident: bool = False,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCacheBuffer.{name} must be a positive int, got {value!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"KVCacheBuffer.dtype must be a floating dtype, got {dtype}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.resident = resident  # NOTE: every page faulted in at each allocation (InferenceConfig.prefault_kv)
        self._data: torch.Tensor | None = None
        if allocate:
            self.allocate()

    # -- storage ---------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes the buffer occupies when allocated (also when it is not: it sizes a budget)."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def is_allocated(self) -> bool:
        return self._data is not None

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            raise RuntimeError("KVCacheBuffer is not allocated (suspended?); call allocate() first")
        return self._data

    def allocate(self) -> None:
        """Allocate (zero-filled) storage; a no-op when already allocated."""
        if self._data is not None:
            return
        self._data = returnable_zeros(self.shape, self.dtype, self.device, resident=self.resident)

    def deallocate(self) -> None:
        """Drop the storage so that suspend frees the memory; contents are lost.

        On CPU the mapping is unmapped when the last tensor viewing it goes (see the class
        invariant on views).
        """
        self._data = None

    def layer(self, i: int) -> torch.Tensor:
        """`[2, num_blocks, block_size, H, D]` view of layer `i` (index 0 = K, 1 = V)."""
        return self.data[i]

    # -- writes ----------------------------------------------------------------------------------

    def store(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V rows `[T, H, D]` of `layer` into the slots `slot_mapping` (int64 `[T]`).

        Slots must be distinct and in `[0, num_slots)`; this is not checked (hot path).
        NOTE: on the CPU, rows already in the buffer's dtype go through the native kernel (a memcpy
        a row, `csrc/store_rows.c`); torch's `index_copy_` copies them an element at a time.
        """
        flat = self.data[layer].view(2, self.num_slots, self.num_kv_heads, self.head_dim)
        if self._native_rows(flat, slot_mapping, k, v):
            item = k.element_size()
            status = native.library().store_rows(flat[0].data_ptr(), flat[1].data_ptr(), k.data_ptr(), v.data_ptr(),
                                                 k.stride(0) * item, slot_mapping.data_ptr(), k.shape[0],
                                                 k.shape[1] * k.shape[2] * item)
            if status:
                raise RuntimeError(f"store_rows failed with status {status}")
            return
        flat[0].index_copy_(0, slot_mapping, k.to(self.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(self.dtype))

    def _native_rows(self, flat: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether `store` can hand its rows to the native kernel: CPU, the buffer's dtype, each
        token's `[H, D]` contiguous and K and V alike, int64 slots one per row."""
        row = k.shape[1] * k.shape[2] if k.dim() == 3 else 0
        return (flat.device.type == "cpu" and k.dtype == v.dtype == self.dtype and k.shape == v.shape
                and k.dim() == 3 and k.shape[1:] == flat.shape[2:] and k.stride() == v.stride()
                and k.stride(2) == 1 and k.stride(1) == k.shape[2] and k.stride(0) >= row
                and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
                and slot_mapping.numel() == k.shape[0] and native.available())

    def copy_blocks(self, src_ids: IdList, dst_ids: IdList) -> None:
        """Copy whole blocks `src_ids[i] -> dst_ids[i]` in every layer (fork of a partial block).

        The sources are read before any destination is written, so overlapping lists behave as
        if all copies happened at once.
        """
        src = self._ids(src_ids)
        dst = self._ids(dst_ids)
        if src.numel() != dst.numel():
            raise ValueError(f"copy_blocks: {src.numel()} sources but {dst.numel()} destinations")
        if src.numel() == 0:
            return
        data = self.data
        data.index_copy_(2, dst, data.index_select(2, src))

    # -- offload (suspend OFFLOAD) ---------------------------------------------------------------

    def offload(self, block_ids: IdList) -> torch.Tensor:
        """Host copy `[num_layers, 2, n, block_size, H, D]` of the given blocks, in that order."""
        ids = self._ids(block_ids)
        # NOTE: pinned host memory makes the device-to-host copy (and the later restore) async-able.
        pin = self.device.type == "cuda"
        out = torch.empty(
            (self.num_layers, 2, ids.numel(), self.block_size, self.num_kv_heads, self.head_dim),
            dtype=self.dtype,
            pin_memory=pin,
        )
        out.copy_(self.data.index_select(2, ids))
        return out

    def restore(self, block_ids: IdList, host_tensor: torch.Tensor) -> None:
        """Write an `offload()` result back into `block_ids` (which may differ from the originals)."""
        ids = self._ids(block_ids)
        expected = (self.num_layers, 2, ids.numel(), self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(host_tensor.shape) != expected:
            raise ValueError(f"restore: tensor shape {tuple(host_tensor.shape)} != expected {expected}")
        self.data.index_copy_(2, ids, host_tensor.to(self.device, self.dtype, non_blocking=True))

    def _ids(self, ids: IdList) -> torch.Tensor:
        t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1).to(self.device)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_blocks):
            raise IndexError(f"block ids must lie in [0, {self.num_blocks}), got {t.tolist()}")
        return t

    def __repr__(self) -> str:
        state = "allocated" if self.is_allocated else "deallocated"
        return (
            f"KVCacheBuffer(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {self.dtype}, {self.device}, {state})"
        )
