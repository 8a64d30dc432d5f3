"""`rollout generate`: the offline job (rejection sampling, best-of-n, a dataset's completions):
prompts from a JSONL file, `n` samples each, to a JSONL file of rollouts, through any backend (a
local engine, a server, a router).

Input, one JSON object a line: the prompt as exactly one of `prompt_ids` (token ids), `prompt`
(text) or `messages` (a chat, rendered by the model's template); `id` (optional, default the line
number) is copied to the output. Output, one line per prompt answered, in input order:
`{"id", "line", "prompt_ids", "samples": [{"index", "completion_ids", "text", "logprobs",
"versions", "finish_reason"}]}` (`text` when the backend has a tokenizer).

A line that cannot be a prompt (not JSON, no prompt or two, bad ids, text without a tokenizer, a
prompt the engine refuses) is reported with its line number and skipped, never dropped in silence.
Prompts go out `chunk` at a time; a seeded run gives prompt k of the file (0-based, bad lines not
counted) the seed `seed + k`, as one `generate()` of all of them would, so the file's samples equal
that call's whatever the chunking. A chunk the backend refuses is split until the prompts it refuses
stand alone, so one bad prompt costs its own line only.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional, Union

from inference import SamplingParams
from rollout.text import is_chat
from rollout.types import Rollout

PROMPT_FIELDS = ("prompt_ids", "prompt", "messages")


@dataclass(slots=True)
class PromptLine:
    line: int  # 1-based, as an editor shows it
    id: Any
    prompt: Union[list[int], str, list[dict]]


@dataclass(slots=True)
class BadLine:
    line: int
    reason: str


@dataclass(slots=True)
class OfflineSummary:
    prompts: int
    samples: int
    completion_tokens: int
    bad: list[BadLine]
    seconds: float

    def format(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"rollout generate: {self.prompts} prompts answered ({self.samples} samples, "
                f"{self.completion_tokens} tokens, {rate:.0f} tok/s), {len(self.bad)} lines skipped")


def parse_line(number: int, text: str) -> Union[PromptLine, BadLine, None]:
    """One input line as a prompt, a reason it is not one, or None (a blank line)."""
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except ValueError as exc:
        return BadLine(number, f"not JSON ({exc})")
    if not isinstance(record, dict):
        return BadLine(number, f"not a JSON object (a {type(record).__name__})")
    given = [f for f in PROMPT_FIELDS if f in record]
    if len(given) != 1:
        return BadLine(number, f"needs exactly one of {', '.join(PROMPT_FIELDS)} (has {', '.join(given) or 'none'})")
    prompt = record[given[0]]
    if given[0] == "prompt_ids":
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return BadLine(number, "prompt_ids must be a non-empty list of token ids (ints >= 0)")
    elif given[0] == "prompt":
        if not isinstance(prompt, str) or not prompt:
            return BadLine(number, "prompt must be a non-empty string")
    elif not is_chat(prompt):
        return BadLine(number, "messages must be a non-empty list of chat messages (objects)")
    return PromptLine(number, record.get("id", number), prompt)


def read_prompts(lines: Iterator[str]) -> tuple[list[PromptLine], list[BadLine]]:
    prompts, bad = [], []
    for number, text in enumerate(lines, start=1):
        parsed = parse_line(number, text)
        if isinstance(parsed, PromptLine):
            prompts.append(parsed)
        elif isinstance(parsed, BadLine):
            bad.append(parsed)
    return prompts, bad


def sample_record(r: Rollout) -> dict[str, Any]:
    out: dict[str, Any] = {"index": r.sample_index, "completion_ids": list(r.completion_ids),
                           "logprobs": list(r.logprobs), "versions": list(r.versions),
                           "finish_reason": r.finish_reason.value}
    if r.text is not None:
        out["text"] = r.text
    return out


class OfflineGeneration:
    """Prompts of a file through `backend` (a `RolloutBackend`: `generate(prompts, n, sampling)`)."""

    def __init__(self, backend: Any, n: int, sampling: SamplingParams, *, chunk: int = 256,
                 timeout: Optional[float] = None) -> None:
        if n < 1 or chunk < 1:
            raise ValueError(f"OfflineGeneration: n >= 1 and chunk >= 1, got {n}, {chunk}")
        self.backend, self.n, self.sampling, self.chunk, self.timeout = backend, n, sampling, chunk, timeout

    def _seeded(self, first: int) -> SamplingParams:
        """The sampling of a chunk whose first prompt is prompt `first` of the file."""
        if self.sampling.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=self.sampling.seed + first)

    def _generate(self, prompts: Sequence[PromptLine], first: int) -> list[list[Rollout]]:
        batch = self.backend.generate([p.prompt for p in prompts], self.n, self._seeded(first), timeout=self.timeout)
        by_group: list[list[Rollout]] = [[] for _ in prompts]
        for r in batch:
            by_group[r.group].append(r)
        return [sorted(g, key=lambda r: r.sample_index) for g in by_group]

    def _answer(self, part: Sequence[PromptLine], first: int, bad: list[BadLine]) -> list[Optional[list[Rollout]]]:
        """Each prompt's samples, None for one the backend refuses (its line goes to `bad`). A refused
        call is split in halves until the refused prompts stand alone: one bad prompt among k costs
        about 2 log2(k) calls, not k."""
        try:
            return list(self._generate(part, first))
        except Exception as exc:  # noqa: BLE001 (the backend's refusal, whatever its type, is the line's reason)
            if len(part) == 1:
                bad.append(BadLine(part[0].line, f"refused: {type(exc).__name__}: {exc}"))
                return [None]
        half = len(part) // 2
        return self._answer(part[:half], first, bad) + self._answer(part[half:], first + half, bad)

    def run(self, prompts: Sequence[PromptLine], out: IO[str], bad: list[BadLine], progress: bool = True
            ) -> tuple[int, int, int]:
        """Write the answers of `prompts` to `out`; refused prompts go to `bad`. (prompts answered,
        samples, completion tokens)."""
        bar = _bar(len(prompts), progress)
        answered = samples = tokens = 0
        try:
            for start in range(0, len(prompts), self.chunk):
                part = prompts[start:start + self.chunk]
                groups = self._answer(part, start, bad)
                for p, group in zip(part, groups):
                    if group is None:
                        continue
                    record = {"id": p.id, "line": p.line, "prompt_ids": list(group[0].prompt_ids),
                              "samples": [sample_record(r) for r in group]}
                    out.write(json.dumps(record) + "\n")
                    answered += 1
                    samples += len(group)
                    tokens += sum(len(r.completion_ids) for r in group)
                bar.update(len(part))
        finally:
            bar.close()
        return answered, samples, tokens


def _bar(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="prompt", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


def generate_file(backend: Any, input_path: Path, output_path: Path, n: int, sampling: SamplingParams, *,
                  chunk: int = 256, progress: bool = True, timeout: Optional[float] = None,
                  report: Optional[IO[str]] = None) -> OfflineSummary:
    """`input_path`'s prompts through `backend` into `output_path` (see module docstring); each
    skipped line is reported to `report` (default stderr) as `line N: reason`."""
    import time

    report = sys.stderr if report is None else report
    with open(input_path, encoding="utf-8") as f:
        prompts, bad = read_prompts(iter(f))
    start = time.perf_counter()
    with open(output_path, "w", encoding="utf-8") as out:
        answered, samples, tokens = OfflineGeneration(backend, n, sampling, chunk=chunk, timeout=timeout).run(
            prompts, out, bad, progress)
    bad.sort(key=lambda b: b.line)
    for b in bad:
        print(f"{input_path}: line {b.line}: {b.reason} (skipped)", file=report)
    return OfflineSummary(answered, samples, tokens, bad, time.perf_counter() - start)


# ---- the command ---------------------------------------------------------------------------------


def add_generate_arguments(parser: Any) -> None:
    import os

    parser.add_argument("--input", required=True, type=Path,
                        help="prompts, one JSON object a line (see rollout.offline)")
    parser.add_argument("--output", required=True, type=Path, help="rollouts, one JSON object per prompt answered")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a local engine on this model directory (or `smollm2`)")
    where.add_argument("--connect", help="a `rollout serve` or `rollout route` address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--tokenizer", help="with --connect: the model directory whose tokenizer encodes text and "
                        "chat prompts and decodes completions (default: ids only)")
    parser.add_argument("--token", default=os.environ.get("ROLLOUT_TOKEN"), help="the service's shared secret")
    parser.add_argument("-n", "--samples", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens per sample")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, help="prompt k of the file sampled with seed + k (reproducible)")
    parser.add_argument("--chunk", type=int, default=256, help="prompts per call to the backend")
    parser.add_argument("--timeout", type=float, default=3600.0, help="bound of each call, seconds")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    local = parser.add_argument_group("local engine (--model)")
    local.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                       help="auto (default): the checkpoint's dtype, as vLLM's; float32 on request")
    local.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    local.add_argument("--batch-invariant", action="store_true",
                       help="each sample the same bits whatever else its chunk holds (InferenceConfig.batch_invariant)")
    local.add_argument("--num-blocks", type=int, help="KV blocks (default: the engine's)")
    local.add_argument("--max-requests", type=int, default=256)
    local.add_argument("--max-seq-len", type=int, default=4096)


def generate_main(args: Any) -> int:
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=args.max_tokens, seed=args.seed)
    if args.connect:
        from rollout.client.sync import RolloutClient
        from rollout.wire.security import ClientSecurity

        backend = RolloutClient(args.connect, timeout=args.timeout, tokenizer=args.tokenizer,
                                security=ClientSecurity(token=args.token) if args.token else None)
    else:
        import torch

        from inference import InferenceConfig
        from rollout.local import RolloutEngine
        from rollout.server.serve import model_path

        if args.threads:
            torch.set_num_threads(args.threads)
        config = InferenceConfig(max_requests=args.max_requests, max_sequence_length=args.max_seq_len,
                                 dtype=args.dtype, batch_invariant=args.batch_invariant,
                                 **({"num_blocks": args.num_blocks} if args.num_blocks else {}))
        backend = RolloutEngine(model_path(args.model, args.dtype), config)
    try:
        summary = generate_file(backend, args.input, args.output, args.samples, sampling, chunk=args.chunk,
                                progress=args.progress, timeout=args.timeout)
    except (OSError, ValueError) as exc:
        print(f"rollout generate: {exc}", file=sys.stderr)
        return 2
    finally:
        backend.close()
    print(summary.format(), flush=True)
    return 0 if summary.prompts or not summary.bad else 1
