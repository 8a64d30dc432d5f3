"""Generation: one HTTP request's samples, from the async client to text, ids and deltas.

The engine knows token ids only; this is where text happens, on the HTTP front's event loop,
never on the engine's: decoding, stop strings (the engine stops on token ids), and what a
streaming client may be shown yet.

* Ids are never changed: a sample's `ids` are the ids sampled, in order. A stop string cuts them
  after the token that completed it (that token included, as vLLM does), and the text before the
  stop string (or through it, with `include_stop`).
* Stop strings are watched on the token stream; when every sample of the request has stopped or
  finished, the request is aborted on the server (the engine's samples are not cut one by one:
  a stopped sample of an `n > 1` request runs on until its siblings finish).
* Streaming holds back what a stop string could still take back: the last `max(len(stop)) - 1`
  characters of text and the last `max(len(stop))` tokens (a token spells at least one
  character), and an incomplete UTF-8 tail.
* Top log-probs and prompt log-probs travel with a sample's final output only, so a streaming
  request that asks for them gets each sample in one delta when it finishes (the same data,
  coarser).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

from inference import FinishReason, SamplingParams
from rollout.http.core.errors import APIError, from_exception
from rollout.text import TextCodec
from rollout.types import Rollout, TokenChunk

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenSpec:
    """What to generate: `n` samples of each prompt, and how to present them."""

    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    stops: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    session_id: Optional[str] = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    whole: bool = False  # stream each sample in one delta when it finishes (echo scoring a prompt)
    input_logprobs_from: int = -1  # SGLang's logprob_start_len: answer the prompt's log-probs from there

    @property
    def top_logprobs(self) -> int:
        return self.sampling.logprobs or 0


class Sample:
    """One choice: its ids, log-probs and versions as sampled, its text, what was sent so far."""

    __slots__ = ("group", "index", "ids", "logprobs", "versions", "top_logprobs", "prompt_logprobs", "prompt_ranks",
                 "text",
                 "routed_experts", "cached_tokens", "finish_reason", "matched", "stopped", "finished", "sent_text",
                 "sent_ids", "_searched")

    def __init__(self, group: int, index: int) -> None:
        self.group, self.index = group, index
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.top_logprobs: Optional[list[dict[int, float]]] = None
        self.prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None  # the engine's, when asked
        self.prompt_ranks: Optional[list[Optional[int]]] = None  # each prompt token's vocabulary rank, with them
        self.routed_experts: Any = None  # MoE, when asked: `[positions fed, moe layers, k]` int32 (final only)
        self.cached_tokens = 0  # prompt tokens the prefix cache served (final only)
        self.text = ""
        self.finish_reason: Optional[FinishReason] = None
        self.matched: Any = None  # the stop string, or the id of the stop token / EOS that ended it
        self.stopped = False  # cut by a stop string (the engine may still be sampling it)
        self.finished = False  # its final output arrived
        self.sent_text = 0
        self.sent_ids = 0
        self._searched = 0

    @property
    def done(self) -> bool:
        return self.stopped or self.finished

    def truncate(self) -> None:
        """Drop what was sampled (echo with `max_tokens: 0`: the prompt scored, nothing generated)."""
        self.ids, self.logprobs, self.versions, self.text = [], [], [], ""
        self.top_logprobs = None if self.top_logprobs is None else []
        self.finish_reason, self.matched = FinishReason.LENGTH, None


@dataclass(slots=True)
class Delta:
    """What a sample adds to its stream: text, ids (with log-probs, top log-probs), and its finish."""

    sample: Sample
    text: str
    start: int  # index of the first of `ids` in the sample
    ids: list[int]
    finish_reason: Optional[FinishReason] = None


def version_spans(versions: list[int], start: int = 0) -> list[dict[str, int]]:
    """Runs of equal policy versions as `[{"version", "start", "end"}]` (token positions, end exclusive):
    the provenance every route answers (`weight_versions`) beside a sample's ids."""
    spans: list[dict[str, int]] = []
    for i, v in enumerate(versions, start):
        if spans and spans[-1]["version"] == v and spans[-1]["end"] == i:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": int(v), "start": i, "end": i + 1})
    return spans


class Generation:
    """Runs one `GenSpec` through the front's async client (see module docstring).

    `deltas()` yields as samples progress (only finished samples unless `spec.stream`); after it
    ends, `samples` holds every choice complete. Registered with the front under `spec.rid`
    while it runs, so `/abort_request` can reach it.
    """

    def __init__(self, front: Any, spec: GenSpec) -> None:
        self.front, self.spec = front, spec
        self.codec: TextCodec = front.codec
        self.samples = [Sample(g, i) for g in range(len(spec.prompts)) for i in range(spec.n)]
        self._by_key = {(s.group, s.index): s for s in self.samples}
        self._hold = max((len(s) for s in spec.stops), default=0)
        whole = spec.whole or spec.top_logprobs > 0 or spec.sampling.prompt_logprobs is not None
        self._coarse = spec.stream and whole
        self._stream: Any = None
        self.started = time.perf_counter()
        self.seconds = 0.0

    async def deltas(self) -> AsyncIterator[Delta]:
        spec = self.spec
        tokens = bool(spec.stops) or (spec.stream and not self._coarse)
        routing = {"session_id": spec.session_id} if spec.session_id else {}
        sampling = spec.sampling
        if spec.session_id and sampling.session_id is None:  # NOTE: the engine keys a salted session's turns by it
            sampling = dataclasses.replace(sampling, session_id=spec.session_id)
        stream = self.front.client.stream(spec.prompts, spec.n, sampling, tokens=tokens,
                                          timeout=self.front.timeout, **routing)
        self._stream = stream
        self.front.inflight[spec.rid] = self
        aborted = False
        try:
            async for item in stream:
                sample = self._by_key[(item.group, item.sample_index)]
                if isinstance(item, TokenChunk):
                    if sample.done:
                        continue
                    self._extend(sample, item)
                    if spec.stream and not self._coarse:
                        delta = self._delta(sample)
                        if delta is not None:
                            yield delta
                    if not aborted and all(s.done for s in self.samples):
                        aborted = True  # every choice is complete: free the engine now
                        await self._abort_running(stream)
                    continue
                self._finish(sample, item)
                if spec.stream:
                    delta = self._delta(sample)
                    if delta is not None:
                        yield delta
        finally:
            self.front.inflight.pop(spec.rid, None)
            if stream.unfinished():
                stream._give_up()  # a client gone mid-stream, or a failure: the engine stops too
            self.seconds = time.perf_counter() - self.started

    @staticmethod
    async def _abort_running(stream: Any) -> None:
        """Abort what still runs; its partial outputs still come (and are cut where they stopped)."""
        try:
            await stream.abort()
        except Exception:  # noqa: BLE001 (finished meanwhile, or the server went away: the stream says)
            logger.debug("abort after stop strings failed", exc_info=True)

    async def run(self) -> list[Sample]:
        """Every sample, once all finished; the engine's refusal raised as the HTTP error it means."""
        try:
            async for _ in self.deltas():
                pass
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 (the engine's refusal, as the HTTP error it means)
            raise from_exception(exc) from exc
        return self.samples

    async def abort(self) -> None:
        """Abort the running samples; they still come back (reason `abort`, with their tokens)."""
        if self._stream is not None and self._stream.unfinished():
            await self._abort_running(self._stream)

    # ---- per sample ------------------------------------------------------------------------------

    def _extend(self, sample: Sample, chunk: TokenChunk) -> None:
        if chunk.start != len(sample.ids):  # NOTE: the client sends each token once, in order
            raise RuntimeError(f"token chunk at {chunk.start} for a sample of {len(sample.ids)} tokens")
        sample.ids.extend(chunk.token_ids)
        sample.logprobs.extend(chunk.logprobs)
        sample.versions.extend(chunk.versions)
        sample.text = self.codec.decode(sample.ids, skip_special_tokens=self.spec.skip_special_tokens)
        if self.spec.stops:
            self._find_stop(sample)

    def _find_stop(self, sample: Sample) -> None:
        text = sample.text.rstrip("\ufffd")
        start = max(0, sample._searched - self._hold + 1)
        found = min(((text.find(s, start), s) for s in self.spec.stops if text.find(s, start) >= 0),
                     default=None)
        sample._searched = len(text)
        if found is None:
            return
        pos, stop = found
        end = pos + len(stop)
        cut = len(sample.ids)  # the shortest prefix of ids whose text reaches through the stop string
        while cut > 1 and len(self.codec.decode(sample.ids[:cut - 1],
                                                skip_special_tokens=self.spec.skip_special_tokens)) >= end:
            cut -= 1
        del sample.ids[cut:], sample.logprobs[cut:], sample.versions[cut:]
        sample.text = text[:end] if self.spec.include_stop else text[:pos]
        sample.stopped, sample.finish_reason, sample.matched = True, FinishReason.STOP, stop

    def _finish(self, sample: Sample, rollout: Rollout) -> None:
        sample.finished = True
        sample.prompt_logprobs = rollout.prompt_logprobs
        sample.prompt_ranks = rollout.prompt_logprob_ranks
        sample.routed_experts = rollout.routed_experts
        sample.cached_tokens = rollout.cached_tokens
        if sample.stopped:  # cut earlier: keep the cut, take the top log-probs of its tokens
            if rollout.top_logprobs is not None:
                sample.top_logprobs = rollout.top_logprobs[:len(sample.ids)]
            return
        sample.ids = list(rollout.completion_ids)
        sample.logprobs = list(rollout.logprobs)
        sample.versions = list(rollout.versions)
        sample.top_logprobs = rollout.top_logprobs
        sample.text = self.codec.decode(sample.ids, skip_special_tokens=self.spec.skip_special_tokens)
        if self.spec.stops:
            sample._searched = 0
            self._find_stop(sample)
            if sample.stopped:
                return
        sample.finish_reason = rollout.finish_reason
        if rollout.finish_reason is FinishReason.STOP and sample.ids:
            sample.matched = sample.ids[-1]

    def _delta(self, sample: Sample) -> Optional[Delta]:
        """What can be sent of `sample` now (everything once it is done)."""
        final = sample.finished
        if final:
            text_end, ids_end = len(sample.text), len(sample.ids)
        else:
            text = sample.text.rstrip("\ufffd")
            text_end = len(text) - max(0, self._hold - 1)
            ids_end = len(sample.ids) - self._hold
        text_end, ids_end = max(text_end, sample.sent_text), max(ids_end, sample.sent_ids)
        if text_end == sample.sent_text and ids_end == sample.sent_ids and not final:
            return None
        delta = Delta(sample, sample.text[sample.sent_text:text_end], sample.sent_ids,
                      sample.ids[sample.sent_ids:ids_end], sample.finish_reason if final else None)
        sample.sent_text, sample.sent_ids = text_end, ids_end
        if final and delta.finish_reason is None:
            delta.finish_reason = FinishReason.ABORT
        return delta
