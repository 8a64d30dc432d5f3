"""RolloutBackend: the one interface of an engine to an RL loop, in process or behind ZMQ.

`rollout.RolloutEngine` (the engine in the trainer's process) and `rollout.RolloutClient` (an
engine server elsewhere) both implement it, so a loop switches from colocated to remote by
changing the line that builds its backend:

    backend: RolloutBackend = RolloutEngine(policy, config)          # colocated
    backend: RolloutBackend = RolloutClient("tcp://127.0.0.1:5555")  # remote

What differs is said where it differs: weights for `update_weights` come from a safetensors
directory both can read (in process, also as named tensors); `GenerationStats` of a remote batch
carries what the client measures (time, tokens), not the engine's step counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Optional, Protocol, Union, runtime_checkable

from inference import SamplingParams
from rollout.control import ControlCalls
from rollout.types import Rollout, RolloutBatch, TokenChunk

Prompts = Sequence[Sequence[int]]


class SampleStream(Protocol):
    """The samples of one `stream()` call, as each finishes (in finishing order).

    Iterating yields a `Rollout` per sample (its `group` is the prompt's index in the call), and
    before it `TokenChunk`s if the call asked for tokens; it ends after the last sample. `abort()`
    finishes the samples still running (their partial `Rollout`s still come, reason `abort`).
    """

    def __iter__(self) -> Iterator[Union[Rollout, TokenChunk]]: ...

    def abort(self) -> None: ...

    def result(self, timeout: Optional[float] = None) -> list[Rollout]:
        """Every sample (chunks skipped), in prompt order, a prompt's samples by index."""


@runtime_checkable
class RolloutBackend(ControlCalls, Protocol):
    """What an RL loop asks of an engine (see module docstring): generation here, and every control
    call (`pause`, `suspend`, `update_weights`, `stats`, ...: `rollout.control.ControlCalls`)."""

    def generate(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
                 timeout: Optional[float] = None, session_id: Optional[str] = None,
                 group_id: Optional[str] = None) -> RolloutBatch:
        """`n` samples of every prompt, grouped by prompt in prompt order (`sampling.n` is replaced
        by `n`; a seeded `sampling` gives prompt i the seed `seed + i`).

        Routing hints, for a router over replicas (`rollout.router.router`; one engine has nothing to
        route and ignores them): `session_id` keeps a multi-turn agent's calls on one replica,
        `group_id` keeps this call's prompts (and later calls with the same id) on one replica, at
        one policy version."""

    def stream(self, prompts: Prompts, n: int = 1, sampling: Optional[SamplingParams] = None, *,
               tokens: bool = False, timeout: Optional[float] = None, session_id: Optional[str] = None,
               group_id: Optional[str] = None) -> SampleStream:
        """The same samples as `generate`, each as it finishes (and its tokens as they come)."""

    def abort(self, stream: SampleStream) -> None:
        """Finish a stream's running samples now (see `SampleStream.abort`)."""

    @property
    def policy_version(self) -> int: ...

    def close(self) -> None: ...


def params_per_prompt(num_prompts: int, n: int, sampling: Optional[SamplingParams]) -> list[SamplingParams]:
    """One `SamplingParams` per prompt: `n` samples; a seeded base gives prompt i `seed + i` (the
    engine mixes seed and sample index into each sample's stream), so a call is reproducible
    whatever the scheduling, in process or not."""
    base = sampling or SamplingParams()
    if base.seed is None:
        params = dataclasses.replace(base, n=n)
        return [params] * num_prompts
    return [dataclasses.replace(base, n=n, seed=(base.seed + i) % 2**64) for i in range(num_prompts)]


def sort_rollouts(rollouts: Iterable[Rollout]) -> list[Rollout]:
    """Prompt order, a prompt's samples by index: the layout of a `RolloutBatch`."""
    return sorted(rollouts, key=lambda r: (r.group, r.sample_index))
