"""Parent-chained block hashes for prefix caching.

A full block's hash digests its parent's hash, an optional namespace key and its own token ids,
so equal hashes mean equal prefixes (up to a 2^-63 collision chance), and "block N is cached"
implies "blocks 0..N-1 are cached". Hashes are stable across processes and Python runs (a keyed
blake2b digest, never `hash()` of str/bytes), positive 63-bit ints. `NO_PARENT` (0) marks the
start of a chain and `UNSET_HASH` (-1) a block without a hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Union

import msgpack

NO_PARENT = 0
UNSET_HASH = -1
_MASK_63 = (1 << 63) - 1

ExtraKey = Union[None, int, str, bytes, tuple, list]


def encode_extra_key(extra_key: ExtraKey) -> bytes:
    """The bytes `block_hashes` mixes into every block for `extra_key` (b"" for None)."""
    if extra_key is None:
        return b""
    # NOTE: msgpack's encoding of ints/str/bytes/sequences is canonical, so the digest is stable.
    try:
        return msgpack.packb(extra_key, use_bin_type=True)
    except TypeError as exc:
        raise TypeError(f"extra_key must be built of int/str/bytes/tuple/list, got {extra_key!r}") from exc


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent_hash: int = NO_PARENT,
    extra_key: ExtraKey = None,
) -> list[int]:
    """Hashes of the full blocks of `token_ids`, each chained to the one before it.

    `parent_hash` continues an earlier chain (the hash of the block before `token_ids[0]`).
    `extra_key` namespaces the whole chain: equal tokens under different keys never share a hash.
    A trailing partial block gets no hash.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if parent_hash < 0:
        raise ValueError(f"parent_hash must be >= 0 (0 = no parent), got {parent_hash}")
    return packed_block_hashes(array("q", token_ids).tobytes(), block_size, parent_hash, encode_extra_key(extra_key))


def packed_block_hashes(packed: bytes, block_size: int, parent_hash: int, salt: bytes) -> list[int]:
    """`block_hashes` of token ids packed as native int64 (`array("q")` or an int64 numpy row's
    bytes) under the key `encode_extra_key` gave `salt`; arguments are not checked (the engine's
    per-step path)."""
    stride = block_size * 8
    hashes: list[int] = []
    parent = parent_hash
    for start in range(0, len(packed) // stride * stride, stride):
        parent = chained_hash(parent, salt, packed[start : start + stride])
        hashes.append(parent)
    return hashes


def chained_hash(parent_hash: int, salt: bytes, packed_block: bytes) -> int:
    """The hash of one block (its token ids packed as in `packed_block_hashes`) after `parent_hash`."""
    digest = hashlib.blake2b(parent_hash.to_bytes(8, "little") + salt + packed_block, digest_size=8).digest()
    return (int.from_bytes(digest, "little") & _MASK_63) or 1  # NOTE: 0 is reserved for "no parent"
