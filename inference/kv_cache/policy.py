"""How cached blocks leave the prefix cache."""

from enum import Enum


class EvictionPolicy(str, Enum):
    """REF_ZERO: a block is deregistered and freed as soon as no request holds it.
    LRU: it stays cached at zero references and is evicted on demand, least recently used leaf first.
    """

    REF_ZERO = "ref_zero"
    LRU = "lru"


class PrefixCachePolicy(str, Enum):
    """Which cached blocks a request may match across weight updates.

    RESET: every update makes the cache unmatchable (exact: a hit is always K/V the current
    weights computed). SALTED: a request, its group and its session key their blocks by the
    version they started with, so later turns and KEEP requests reuse their own blocks across
    updates (faster; the reused K/V is as old as the start version, see `max_staleness`).
    """

    RESET = "reset"
    SALTED = "salted"
