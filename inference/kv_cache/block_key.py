"""The key every prefix-cache block is hashed and matched under: one definition for all callers.

A block's hash chains its parent's hash, its tokens and its key, so blocks under different keys
never share a hash. The key names whose K/V the chain is: the cache `salt` (a tenant, a caller's
own namespace), the policy `version` the chain is keyed by (the current one, or under a salted
prefix-cache policy the version its request / group / session started with) and, reserved for
LoRA, the adapter and its version. Fields left None add nothing to the hash, so the digest of a
key without salt or adapter is the one chains had before keys grew (routers hash alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from inference.kv_cache.hashing import ExtraKey


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Namespace of one hash chain; equal keys are the only ones whose blocks may be shared.

    Invariant: `version >= 0`; `adapter_version` is set only with an `adapter_id`.
    """

    version: int
    salt: Optional[str] = None
    adapter_id: Optional[str] = None
    adapter_version: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"BlockKey.version must be an int >= 0, got {self.version!r}")
        if self.adapter_version is not None and self.adapter_id is None:
            raise ValueError("BlockKey.adapter_version needs an adapter_id")

    def hash_key(self) -> ExtraKey:
        """What `block_hashes` mixes into every block of the chain (see module docstring)."""
        if self.adapter_id is not None:
            return (self.version, self.salt, self.adapter_id, self.adapter_version)
        return self.version if self.salt is None else (self.version, self.salt)
