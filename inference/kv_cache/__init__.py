"""Prefix-cache bookkeeping of the paged KV memory: the block allocator, block hashes and KV events."""

from inference.kv_cache.allocator import KVBlockAllocator, KVPoolStats
from inference.kv_cache.block_key import BlockKey
from inference.kv_cache.block_state import (
    MAX_CACHED_PROMPT_TOP_N_LOGPROBS,
    PrefixCacheBlockState,
    PromptLogprobsBlock,
)
from inference.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventHub
from inference.kv_cache.hashing import NO_PARENT, UNSET_HASH, block_hashes
from inference.kv_cache.policy import EvictionPolicy, PrefixCachePolicy
from inference.kv_cache.registry import PrefixCacheRegistry

__all__ = [
    "MAX_CACHED_PROMPT_TOP_N_LOGPROBS",
    "NO_PARENT",
    "UNSET_HASH",
    "AllBlocksCleared",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "EvictionPolicy",
    "KVBlockAllocator",
    "KVEvent",
    "KVEventHub",
    "KVPoolStats",
    "PrefixCacheBlockState",
    "PrefixCachePolicy",
    "PrefixCacheRegistry",
    "PromptLogprobsBlock",
    "block_hashes",
]
