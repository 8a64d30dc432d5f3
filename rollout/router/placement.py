"""Placement: which replica a router sends a Generate to. Pure bookkeeping, no sockets, no clock.

In order of precedence:

1. group: Generates that share a `group_id` (a GRPO group sent one sample per request) go where
   the group's first one went: its prompt blocks are computed once and shared;
2. session: a `session_id` (a multi-turn agent) sticks to the replica of its previous turn, which
   holds the conversation so far in its prefix cache;
3. prefix: the replica that can serve the longest cached prefix of the prompt wins, unless its
   load is far above the least loaded one's (`PlacementConfig.load_imbalance` / `load_slack_tokens`);
4. least loaded: by the tokens the router has sent it and not yet seen come back (prompt plus
   `max_tokens` per unfinished sample), ties to the replica that was given fewer requests.

A sticky replica that is no longer a candidate (down, or on another policy version) is replaced
through the rules below it. The prefix view of each replica is its KV events (`KvEvents`, fed by
the router's polls) plus what the router itself just sent there (a burst of one prompt is
placed together before the first forward pass announces its blocks); a CLEARED event (a cache
reset, a weight update, a suspend) or a lost stretch of events wipes that view.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from rollout.wire.kv_events import KvEvent, KvOp


class Reason(str, enum.Enum):
    """Why a request went where it went (counted per replica)."""

    GROUP = "group"
    SESSION = "session"
    PREFIX = "prefix"
    LEAST_LOADED = "least_loaded"


@dataclass(slots=True)
class PlacementConfig:
    """`load_imbalance` / `load_slack_tokens`: the replica with the longest cached prefix wins
    unless its load exceeds `load_imbalance * least + load_slack_tokens`. `max_sticky`: sessions
    and groups remembered (least recently used forgotten first). `max_index_hashes`: the prefix
    view of one replica is dropped whole past this many hashes (a heuristic, bounded)."""

    load_imbalance: float = 2.0
    load_slack_tokens: int = 2048
    max_sticky: int = 100_000
    max_index_hashes: int = 2_000_000

    def __post_init__(self) -> None:
        if not self.load_imbalance >= 1.0:
            raise ValueError(f"PlacementConfig.load_imbalance must be >= 1, got {self.load_imbalance!r}")
        for name in ("load_slack_tokens", "max_sticky", "max_index_hashes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"PlacementConfig.{name} must be an int >= 0, got {value!r}")


class PrefixIndex:
    """The block hashes one replica is believed to serve.

    Hashes chain their parents (`inference.kv_cache.hashing`), so a prompt's match is the run of
    its leading hashes present here.
    """

    __slots__ = ("hashes", "limit")

    def __init__(self, limit: int) -> None:
        self.hashes: set[int] = set()
        self.limit = limit

    def stored(self, hashes: Iterable[int]) -> None:
        self.hashes.update(hashes)
        if len(self.hashes) > self.limit:
            self.hashes.clear()  # NOTE: forgetting costs preferences only, never a request

    def removed(self, hashes: Iterable[int]) -> None:
        self.hashes.difference_update(hashes)

    def clear(self) -> None:
        self.hashes.clear()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt with these hashes are cached."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n


class _Lru(OrderedDict):
    """A bounded map that forgets its least recently used keys."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def touch(self, key: str, value: object) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class Placement:
    """Chooses replicas (see module docstring) and keeps the figures it chooses by.

    Invariants: `load[r]` is the sum of the costs assigned to `r` and not yet released (never
    negative); every replica has a prefix view and a load from `add` to `remove`.
    """

    def __init__(self, config: Optional[PlacementConfig] = None) -> None:
        self.config = config or PlacementConfig()
        self.load: dict[str, int] = {}
        self.routed: Counter[tuple[str, Reason]] = Counter()
        self._index: dict[str, PrefixIndex] = {}
        self._assigned: Counter[str] = Counter()
        self._sessions = _Lru(self.config.max_sticky)
        self._groups = _Lru(self.config.max_sticky)

    # ---- replicas ------------------------------------------------------------------------------

    def add(self, name: str) -> None:
        self.load.setdefault(name, 0)
        self._index.setdefault(name, PrefixIndex(self.config.max_index_hashes))

    def remove(self, name: str) -> None:
        """Forget a replica's figures (its sticky sessions and groups move when next seen)."""
        self.load.pop(name, None)
        self._index.pop(name, None)

    def forget_cache(self, name: str) -> None:
        """The replica's prefix cache is gone (it restarted, or was taken out)."""
        if name in self._index:
            self._index[name].clear()

    def kv_events(self, name: str, events: Iterable[KvEvent], reset: bool = False) -> None:
        """Apply a replica's prefix-cache events in order; `reset`: some were lost before them."""
        index = self._index.get(name)
        if index is None:
            return
        if reset:
            index.clear()
        for event in events:
            if event.op is KvOp.STORED:
                index.stored(event.hashes)
            elif event.op is KvOp.REMOVED:
                index.removed(event.hashes)
            else:
                index.clear()

    def match(self, name: str, hashes: Sequence[int]) -> int:
        index = self._index.get(name)
        return 0 if index is None else index.match(hashes)

    # ---- choosing ------------------------------------------------------------------------------

    def group_of(self, group_id: Optional[str]) -> Optional[tuple[str, int]]:
        """(replica, policy version) where the group started, if it is remembered."""
        return None if group_id is None else self._groups.get(group_id)

    def choose(self, candidates: Sequence[str], hashes: Sequence[int], *, session_id: Optional[str] = None,
               group_id: Optional[str] = None) -> tuple[str, Reason]:
        """The replica for a request among `candidates` (non-empty), and why."""
        if not candidates:
            raise ValueError("Placement.choose: no candidate replica")
        group = self.group_of(group_id)
        if group is not None and group[0] in candidates:
            return group[0], Reason.GROUP
        if session_id is not None:
            sticky = self._sessions.get(session_id)
            if sticky in candidates:
                return sticky, Reason.SESSION
        least = min(candidates, key=self._load_key)
        if hashes:
            matches = {name: self.match(name, hashes) for name in candidates}
            longest = max(matches.values())
            if longest > 0:
                best = min((name for name in candidates if matches[name] == longest), key=self._load_key)
                cfg = self.config
                if self.load.get(best, 0) <= cfg.load_imbalance * self.load.get(least, 0) + cfg.load_slack_tokens:
                    return best, Reason.PREFIX
        return least, Reason.LEAST_LOADED

    def _load_key(self, name: str) -> tuple[int, int, str]:
        return self.load.get(name, 0), self._assigned[name], name

    def assign(self, name: str, reason: Reason, cost: int, hashes: Sequence[int] = (), *,
               session_id: Optional[str] = None, group_id: Optional[str] = None, version: int = 0) -> None:
        """A request was sent to `name`: its load grows by `cost`, its session and group stick
        there, and its prompt's blocks are expected there from now on."""
        self.load[name] = self.load.get(name, 0) + cost
        self._assigned[name] += 1
        self.routed[(name, reason)] += 1
        if session_id is not None:
            self._sessions.touch(session_id, name)
        if group_id is not None:
            self._groups.touch(group_id, (name, version))
        if hashes and name in self._index:
            self._index[name].stored(hashes)

    def release(self, name: str, cost: int) -> None:
        """`cost` tokens of work sent to `name` came back (or will not)."""
        if name in self.load:
            self.load[name] = max(0, self.load[name] - cost)

    def routed_to(self, name: str) -> dict[str, int]:
        """Requests sent to `name`, by reason."""
        return {reason.value: self.routed[(name, reason)] for reason in Reason}
