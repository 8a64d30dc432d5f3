"""Paged decode attention on the CPU through the native kernel (see `inference/csrc/paged_decode.c`):
no gather into a padded batch, so a batch of mixed lengths costs what its tokens cost. Built and
loaded by `inference.native`; without it the attention backend keeps its pure-torch path.
"""

from __future__ import annotations

import torch

from inference import native

_KERNELS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


def supports(dtype: torch.dtype, device: torch.device, num_heads: int, head_dim: int) -> bool:
    # NOTE: the kernel works in eight-float vectors along head_dim
    return (device.type == "cpu" and dtype in _KERNELS and num_heads <= 64 and head_dim <= 256
            and head_dim % 8 == 0 and native.available())


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Decode attention of `q [B, Hq, D]` over the pages `k_cache`, `v_cache` `[blocks, bs, Hkv, D]`
    of one layer, request `b` attending to its first `seq_lens[b]` tokens through
    `block_tables [B, W]` (int32). Writes `out [B, Hq, D]` (contiguous) and returns it: float32, or
    for a bf16 `q` bf16 too (the float32 result rounded once, the same bits as converting after).

    `q`'s rows may lie any distance apart (a view of the step's q, k and v side by side), each row's
    heads contiguous; the caches and `seq_lens` contiguous, block_tables rows any stride. Not checked
    on the hot path beyond what the C code needs.
    """
    batch, num_heads, head_dim = q.shape
    status = getattr(native.library(), _KERNELS[q.dtype])(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), int(out.dtype == torch.bfloat16), batch,
        num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"paged_decode failed with status {status} (a shape it does not handle)")
    return out
