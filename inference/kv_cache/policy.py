"""How cached blocks leave the prefix cache."""

from enum import Enum


class EvictionPolicy(str, Enum):
    """REF_ZERO: a block is deregistered and freed as soon as no request holds it.
    LRU: it stays cached at zero references and is evicted on demand, least recently used leaf first.
    """

    REF_ZERO = "ref_zero"
    LRU = "lru"
