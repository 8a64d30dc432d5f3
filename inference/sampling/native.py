"""The sampler's native fast path: rows sampled from their untruncated softmax in one C call.

`inference/csrc/sample_rows.c` does per row what `sampler.sample` does with six full passes of
torch ops (max, subtract, exp, pad, chunk sums, inverse-CDF search) in one read of the row, on
torch's threads. Same contract: one uniform `u` per row picks the token whose cumulative weight
interval holds `u * total`; tokens of weight zero never win. Used for float32 CPU logits without
top-k / top-p / min-p; everything else keeps the torch path.
"""

from __future__ import annotations

import torch

from inference import native

MAX_VOCAB = 1024 * 1024  # the C kernel's per-row chunk table (csrc/sample_rows.c: CHUNK x MAX_CHUNKS)


def usable(logits: torch.Tensor) -> bool:
    """Whether `sample_rows` takes these logits: float32 rows on the CPU, unit column stride."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and 0 < logits.shape[1] <= MAX_VOCAB and native.available())


def sample_rows(logits: torch.Tensor, inv_t: torch.Tensor, u: torch.Tensor,
                raw: bool = False) -> tuple[torch.Tensor, ...]:
    """Per row of `logits [R, V]`: the sampled token (int64), the row's max (float32), the weight
    sum of exp((x - max) * inv_t) (float64), and with `raw` the sum of exp(x - max) (float64; else
    None). `inv_t` float32 `[R]`, `u` float64 `[R]` in [0, 1)."""
    rows, vocab = logits.shape
    inv_t = inv_t.to(torch.float32).contiguous()
    u = u.to(torch.float64).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    maxes = torch.empty(rows, dtype=torch.float32)
    totals = torch.empty(rows, dtype=torch.float64)
    raw_totals = torch.empty(rows, dtype=torch.float64) if raw else None
    status = native.library().sample_rows_f32(
        logits.data_ptr(), rows, vocab, logits.stride(0), inv_t.data_ptr(), u.data_ptr(), tokens.data_ptr(),
        maxes.data_ptr(), totals.data_ptr(), None if raw_totals is None else raw_totals.data_ptr(),
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"sample_rows_f32 failed with status {status} (vocabulary of {vocab} tokens)")
    return tokens, maxes, totals, raw_totals
