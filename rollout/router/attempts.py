"""A router's view of one client request: where its samples run (`Attempt`s) and what came back.

A client's Generate (a `rollout.service.registry.Record` at the router, exactly once by its client-chosen
id) runs on a replica as an `Attempt`: a Generate the router sends under an id of its own, for
some of the request's sample indices (all of them at first). When a replica is taken out, or a
sample is too stale, the indices still owed are sent again as a new attempt (to a replica, or
held until one can take it); replies of an attempt that was given up are dropped, so the client
gets each sample once, from the attempt that covers it.

Invariant (kept by the router): every sample index of a live record that has not been sent to
the client is owed by exactly one live attempt (in its `left`) or one held entry. (An attempt
for part of a seeded request runs all of it and owes only part: `sent_indices`.)

Staleness (partial rollouts across weight updates): with `max_staleness = k`, a sample may
carry tokens of at most k + 1 consecutive policy versions. What would exceed it is handled per
`StalePolicy`: RECOMPUTE (the default) samples it again, from its prompt, under the current
version; ABORT finishes it now with reason `abort` and the tokens it has.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from inference.kv_cache import BlockKey, block_hashes
from inference.request import FinishReason
from rollout.service.registry import Record
from rollout.wire.messages import Generate, SampleOutput


@dataclass(eq=False, slots=True)
class Attempt:
    """Sample indices `indices` of `record`, running on `replica` under the router's id `id`
    since the replica was at `version`. `left` holds this attempt's own indices (0..k-1) not yet
    back and owed by it (`wanted`, all of them by default); `aborting`: asked to stop, its samples
    come back as they are."""

    id: str
    record: Record
    replica: str
    indices: list[int]
    version: int
    prompt_cost: int
    sample_cost: int
    wanted: Optional[set[int]] = None
    left: set[int] = field(default_factory=set)
    aborting: bool = False

    def __post_init__(self) -> None:
        self.left = set(range(len(self.indices))) if self.wanted is None else set(self.wanted)

    @property
    def runs_extra(self) -> bool:
        """The replica runs samples of it that nobody waits for (see `sent_indices`)."""
        return self.wanted is not None and len(self.wanted) < len(self.indices)

    @property
    def cost(self) -> int:
        """The load it still puts on its replica (see `rollout.router.placement`)."""
        return (self.prompt_cost + self.sample_cost * len(self.left)) if self.left else 0

    def owed(self) -> list[int]:
        """The record's indices this attempt still owes the client."""
        return [self.indices[j] for j in sorted(self.left) if self.indices[j] not in self.record.frames]


@dataclass(eq=False, slots=True)
class Route:
    """The router's state of one record (kept in `Record.stream`)."""

    attempts: dict[str, Attempt] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)  # sample index -> tokens streamed so far
    replicas: list[str] = field(default_factory=list)  # every replica it was sent to, in order
    aborted: bool = False  # the client (or its lease) aborted it: owed samples end as `abort`
    _hashes: Optional[tuple[tuple[int, int], list[int]]] = None

    def prompt_hashes(self, prompt: np.ndarray, block_size: int, version: int,
                      cache_salt: Optional[str] = None) -> list[int]:
        """The prompt's block hashes as a replica at `version` computes them (the blocks it may
        take from its cache: full ones before the last token; a salted request's own chain),
        cached per (block size, version)."""
        key = (block_size, version)
        if self._hashes is None or self._hashes[0] != key:
            usable = (len(prompt) - 1) // block_size * block_size
            self._hashes = (key, block_hashes(prompt[:usable].tolist(), block_size,
                                              extra_key=BlockKey(version, cache_salt).hash_key()))
        return self._hashes[1]


def sent_indices(record: Record, owed: list[int]) -> tuple[list[int], Optional[set[int]]]:
    """The record's sample indices to send a replica for `owed` ones, and which of the sent are
    owed (None: all). A seeded sample's random stream is keyed by its index in its Generate
    (`inference.sampling.seeds.sample_seed(seed, index)`): sent alone as a smaller n, owed samples 2 and 3
    of a seeded request would replay samples 0 and 1. So a seeded request is sent whole and the
    copies of the samples not owed are dropped (failover and recompute only: rare, and correct
    beats cheap)."""
    if record.request.sampling.seed is None or len(owed) == record.n:
        return owed, None
    return list(range(record.n)), set(owed)


def too_stale(versions: np.ndarray, max_staleness: Optional[int]) -> bool:
    """Whether a sample's per-token versions span more than `max_staleness` updates."""
    return max_staleness is not None and versions.size > 0 and int(versions.max()) - int(versions.min()) > max_staleness


def attempt_request(record: Record, attempt_id: str, count: int) -> Generate:
    """The Generate a replica gets for `count` of the record's samples."""
    msg = record.request
    sampling = msg.sampling
    if sampling.n != count:
        sampling = dataclasses.replace(sampling, n=count)
    return Generate(request_id=attempt_id, prompt_token_ids=msg.prompt_token_ids, sampling=sampling,
                    stream_tokens=msg.stream_tokens, session_id=msg.session_id, group_id=msg.group_id,
                    client=record.admission_client)


def aborted_sample(record: Record, index: int) -> SampleOutput:
    """An owed sample that never ran (its request was aborted before a replica took it)."""
    return SampleOutput(request_id=record.request_id, sample_index=index, n=record.n,
                        prompt_len=len(record.request.prompt_token_ids), token_ids=[], logprobs=[], versions=[],
                        finish_reason=FinishReason.ABORT)
