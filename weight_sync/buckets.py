"""Buckets: many tensors flattened into one byte buffer, and the checksum that guards it.

`plan` lays tensors out (see `weight_sync.manifest` for the rules); `pack_bucket` copies a bucket's
tensors into a buffer and returns its checksum, computed on each chunk right after it is copied,
while it is still in cache (a separate pass over a cold buffer cost ~40% of the copy again);
`unpack_bucket` gives views of a received buffer by name, ready for the engine's `load_weights`
(which copies them into memory the engine owns). `bucket_checksum` / `tensor_checksum` are the
receiver's and a pre-computing sender's side of the same sum.

Buffers are flat `uint8` tensors on CPU or CUDA. On CPU the sum is numpy's (wrapping uint64
arithmetic, defined); on CUDA torch's int64 sum, which wraps the same way on every GPU we know of.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch

from weight_sync import memcopy
from weight_sync.manifest import ALIGN, Bucket, Layout, Manifest, align, dtype_name, tensor_nbytes

DEFAULT_BUCKET_BYTES = 512 * 2**20
CHUNK_BYTES = 4 * 2**20  # the checksum reads each copied chunk while it is in cache
_MASK = 2**64 - 1


def word_sum(buf: torch.Tensor) -> int:
    """Sum mod 2**64 of a flat uint8 buffer as little-endian 64-bit words, the last one zero-padded."""
    if buf.device.type == "cpu":
        return memcopy.word_sum(buf.numpy())
    n = buf.numel()
    full = n - n % 8
    words = buf[:full]
    if words.storage_offset() % 8:
        words = words.clone()  # NOTE: a slice that starts off a word: viewing it as int64 is refused
    total = int(words.view(torch.int64).sum().item()) if full else 0
    return (total + memcopy.word_sum(buf[full:].cpu().numpy())) & _MASK


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a copy only if it is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def tensor_checksum(t: torch.Tensor) -> int:
    """The tensor's share of a bucket checksum: its bytes as words, the last one zero-padded."""
    return word_sum(as_bytes(t))


def bucket_checksum(buf: torch.Tensor, bucket: Bucket) -> int:
    """The checksum of a received bucket (`buf` holds at least `bucket.nbytes`)."""
    return word_sum(buf[: bucket.nbytes])


def plan(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]], bucket_bytes: int) -> Layout:
    """Offsets and buckets (checksums 0) for tensors of these dtypes and shapes, in order."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    offsets: list[int] = []
    buckets: list[Bucket] = []
    start, used = 0, 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        size = tensor_nbytes(dtype, shape)
        at = align(used)
        if i > start and at + size > bucket_bytes:
            buckets.append(Bucket(start, i, align(used)))
            start, at = i, 0
        offsets.append(at)
        used = at + size
    if len(offsets) > start:
        buckets.append(Bucket(start, len(offsets), align(used)))
    return Layout(offsets=offsets, buckets=buckets)


def manifest_for(named: Sequence[tuple[str, torch.Tensor]], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 version: int | None = None, packed: bool = True) -> Manifest:
    """The manifest of `named` (checksums still 0: `pack_bucket` or `fill_checksums` sets them)."""
    names = [n for n, _ in named]
    dtypes = [t.dtype for _, t in named]
    shapes = [list(t.shape) for _, t in named]
    layout = plan(dtypes, shapes, bucket_bytes) if packed else None
    return Manifest(names=names, dtypes=[dtype_name(d) for d in dtypes], shapes=shapes, layout=layout,
                    version=version)


def fill_checksums(manifest: Manifest, tensors: Sequence[torch.Tensor]) -> None:
    """Set every bucket's checksum from the source tensors (one read pass, no packing)."""
    assert manifest.layout is not None
    for b in manifest.layout.buckets:
        b.checksum = sum(tensor_checksum(tensors[i]) for i in range(b.start, b.stop)) & _MASK


def pack_bucket(manifest: Manifest, index: int, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> int:
    """Copy bucket `index`'s tensors (all of the manifest's, by position) into `out` (flat uint8,
    at least the bucket's nbytes); gaps are zeroed. Returns the bucket's checksum."""
    layout = manifest.layout
    assert layout is not None
    bucket = layout.buckets[index]
    view = out[: bucket.nbytes]
    dtypes, sizes = manifest.torch_dtypes, manifest.tensor_bytes()
    total, cursor = 0, 0
    with torch.no_grad():
        for i in range(bucket.start, bucket.stop):
            off, size, dtype = layout.offsets[i], sizes[i], dtypes[i]
            if off > cursor:
                view[cursor:off].zero_()
            end = align(off + size, 8)
            if end > off + size:
                view[off + size : end].zero_()
            total += _copy_summed(tensors[i], dtype, view[off:end], size)
            cursor = end
        if cursor < bucket.nbytes:
            view[cursor:].zero_()
    return total & _MASK


def _copy_summed(src: torch.Tensor, dtype: torch.dtype, dst: torch.Tensor, size: int) -> int:
    """Copy `src` (converted to `dtype`) into the byte range `dst` chunk by chunk, summing each
    chunk's words right after its copy (`dst` extends `size` to a multiple of 8, already zeroed)."""
    flat = src.detach().reshape(-1)
    item = torch.empty((), dtype=dtype).element_size()
    step = CHUNK_BYTES // item  # elements per chunk: every chunk but the last ends on a word
    total, n = 0, flat.numel()
    for start in range(0, n, step):
        stop = min(n, start + step)
        lo, hi = start * item, stop * item
        dst[lo:hi].view(dtype).copy_(flat[start:stop])
        total += word_sum(dst[lo : align(hi, 8) if stop == n else hi])
    return total


def unpack_bucket(manifest: Manifest, index: int, buf: Optional[torch.Tensor],
                  direct: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """Views of a bucket's tensors in `buf` by name (valid while `buf` is); a name in `direct` is
    that tensor instead (buffers a receiver's engine handed out: `buf` may be None if it has them all)."""
    layout = manifest.layout
    assert layout is not None
    bucket = layout.buckets[index]
    dtypes, sizes = manifest.torch_dtypes, manifest.tensor_bytes()
    direct = direct or {}
    out = {}
    for i in range(bucket.start, bucket.stop):
        name, off = manifest.names[i], layout.offsets[i]
        if name in direct:
            out[name] = direct[name]
        else:
            out[name] = buf[off : off + sizes[i]].view(dtypes[i]).view(manifest.shapes[i])
    return out


def holds_all(direct: Mapping[str, torch.Tensor], manifest: Manifest, index: int) -> bool:
    """Whether `direct` has every tensor of bucket `index` (no bucket buffer needed)."""
    bucket = manifest.layout.buckets[index]
    return all(name in direct for name in manifest.names[bucket.start : bucket.stop])
