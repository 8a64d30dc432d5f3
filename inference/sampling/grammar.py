"""Structured outputs in the engine: grammars compiled against the tokenizer, one matcher per slot.

llguidance (pinned; its CPU mask path, Rust, GIL released) does the grammar work. Three parts:

* `grammar_text(spec)`: a `StructuredOutputs` as llguidance's grammar, with vLLM's meanings
  (its guidance backend's): `json_object` the schema `{"type": "object"}`, `grammar` Lark or
  GBNF; whitespace in JSON as `whitespace_pattern` says, none with `disable_any_whitespace`, and
  otherwise `BOUNDED_WHITESPACE` (vLLM allows any run of it: a model that wants what the grammar
  forbids then writes newlines until `max_tokens`, a known failure that a bound turns into
  progress; pretty-printed JSON, one newline and an indent of up to 20, still fits).
* `GrammarCompiler`: the engine's; loads the tokenizer on first use (~0.3 s for a 49k vocabulary)
  and compiles each distinct spec once (LRU), a refusal being a `ValueError` naming the field.
  A compiled grammar is a template matcher that is never advanced: each sample gets a copy.
* `GrammarSlots`: the context's, one matcher per slot. `masks(slots)` fills one step's bitmask
  rows (all matchers at once, in llguidance's thread pool); `accept(slots, tokens)` advances them
  and says which rows are done: the grammar stopped (only EOS could follow, which vLLM does not
  emit either) or the token was refused (a contradiction between processors, e.g. `min_tokens`
  banning what the grammar needs; the request ends rather than run on unconstrained).

The mask is part of the processing: PROCESSED log-probs see it, RAW (the model's, what a trainer
recomputes) do not.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import llguidance as llg
import llguidance.numpy as llg_numpy  # NOTE: not llguidance.torch: its import loads torch.compile (~2 s)
import numpy as np
import torch
from torch import Tensor

from inference.errors import OverloadedError
from inference.sampling.grammar_limits import COMPILE_STACK_BYTES, check_limits
from inference.sampling.structured import Constraint, StructuredOutputs

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256
MAX_BUILDS_PER_CLIENT = 4  # grammars one client may have compiling at once (more: OverloadedError)
BOUNDED_WHITESPACE = r"(\r?\n)?[ \t]{0,20}"  # between two JSON tokens
_GRAMMAR_THREADS = 2  # mask filling is a few ms for hundreds of rows; more threads only contend


def grammar_text(spec: StructuredOutputs) -> str:
    """`spec` as an llguidance grammar (not yet checked: `GrammarCompiler.compile` does that)."""
    kind = spec.kind
    if kind in (Constraint.JSON, Constraint.JSON_OBJECT):
        schema = json.loads(spec.json) if kind is Constraint.JSON else {"type": "object"}
        if spec.disable_additional_properties:
            schema = _closed_objects(schema)
        options: dict = {"whitespace_flexible": not spec.disable_any_whitespace}
        if not spec.disable_any_whitespace:
            options["whitespace_pattern"] = spec.whitespace_pattern or BOUNDED_WHITESPACE
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind is Constraint.REGEX:
        return llg.grammar_from("regex", spec.regex)
    if kind is Constraint.CHOICE:
        return llg.grammar_from("choice", json.dumps(list(spec.choice)))
    if kind is Constraint.GRAMMAR:
        return llg.grammar_from("grammar", spec.grammar)
    return _structural_tag(spec.structural_tag)


def _constraint_text(spec: StructuredOutputs) -> Optional[str]:
    """The text `grammar_limits.check_limits` measures for `spec` (None: nothing to measure)."""
    return {Constraint.JSON: spec.json, Constraint.GRAMMAR: spec.grammar, Constraint.REGEX: spec.regex,
            Constraint.STRUCTURAL_TAG: spec.structural_tag}.get(spec.kind)


def _first_line(error: str) -> str:
    """The library's message without the backtrace a panic appends (and at most 2,000 characters)."""
    return _BACKTRACE.split(error.strip(), 1)[0][:2000]


_BACKTRACE = re.compile(r"\n\s*(?:stack )?backtrace|\n\s*\d+: 0x[0-9a-f]+ - ", re.IGNORECASE)


def _closed_objects(schema):
    """The schema with `additionalProperties: false` on every object schema that does not say."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _structural_tag(text: str) -> str:
    """vLLM's structural tag, `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free
    text in which a trigger starts the structure whose `begin` it opens."""
    tag = json.loads(text)
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"]:
        raise ValueError("structured_outputs.structural_tag: needs a non-empty `structures` list")
    triggers = tag.get("triggers")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structured_outputs.structural_tag: needs `triggers`, a list of non-empty strings")
    tags = []
    for s in tag["structures"]:
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), (dict, str))):
            raise ValueError("structured_outputs.structural_tag: each structure has `begin`, `schema`, `end`")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structured_outputs.structural_tag: no trigger starts {s['begin']!r}")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]))
    return llg.StructTag.to_grammar(tags)


class GrammarCompiler:
    """Compiles specs against the tokenizer at `tokenizer` (a `tokenizer.json` or its directory;
    None: this engine has none and refuses structured outputs). `vocab_size` is the logits' width
    (tokens past the tokenizer's are never allowed); `eos_token_ids` end a completed grammar."""

    def __init__(self, tokenizer: str | Path | None, vocab_size: int, eos_token_ids) -> None:
        self.source = None if tokenizer is None else Path(tokenizer)
        if self.source is not None and self.source.is_dir():
            self.source = self.source / "tokenizer.json"
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._tokenizer: llg.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutputs, llg.LLMatcher] = OrderedDict()
        self._refused: OrderedDict[StructuredOutputs, str] = OrderedDict()  # a refusal is compiled once
        self._building: dict[StructuredOutputs, Future] = {}  # one build per spec, however many ask
        self._per_client: dict[str, int] = {}  # builds in flight each client started
        self._lock = threading.Lock()  # NOTE: requests are checked on callers' threads, not only the loop's

    @property
    def available(self) -> bool:
        return self.source is not None and self.source.is_file()

    def tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                if not self.available:
                    raise ValueError("structured_outputs: this engine has no tokenizer (a tokenizer.json beside the "
                                     "model, or InferenceConfig.tokenizer) to compile grammars against")
                try:
                    self._tokenizer = llg.LLTokenizer(str(self.source), n_vocab=self.vocab_size,
                                                      eos_token=self.eos_token_ids or None)
                except (ValueError, RuntimeError) as exc:
                    raise ValueError(f"structured_outputs: the tokenizer {self.source} cannot serve grammars "
                                     f"over {self.vocab_size} logits: {exc}") from None
            return self._tokenizer

    def compile(self, spec: StructuredOutputs) -> llg.LLMatcher:
        """The template matcher of `spec` (cached; never advance it: `GrammarSlots.bind` copies it),
        built on the compile thread while this one waits (`compile_async` does not wait); a
        refused spec raises its `ValueError` again without a second build."""
        return self.compile_async(spec).result()

    def ready(self, spec: StructuredOutputs) -> bool:
        """Whether `compile(spec)` answers at once (built, or refused, before)."""
        with self._lock:
            return spec in self._cache or spec in self._refused

    def compile_async(self, spec: StructuredOutputs, client: Optional[str] = None) -> Future:
        """A `Future` of `spec`'s template (or its `ValueError`), built on the compile thread; a
        spec asked for again while it builds shares that build. `client` (who asks) may have at
        most `MAX_BUILDS_PER_CLIENT` builds in flight: past that `OverloadedError` (retry later), so
        one client sending distinct grammars cannot keep the compile thread to itself."""
        done: Future = Future()
        with self._lock:
            template, refusal = self._cache.get(spec), self._refused.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
        if template is not None:
            done.set_result(template)
            return done
        if refusal is not None:
            done.set_exception(ValueError(refusal))
            return done
        try:
            tokenizer = self.tokenizer()
        except ValueError as exc:
            done.set_exception(exc)
            return done
        with self._lock:
            building = self._building.get(spec)
            if building is not None:
                return building
            if client is not None:
                if self._per_client.get(client, 0) >= MAX_BUILDS_PER_CLIENT:
                    raise OverloadedError(f"structured_outputs: {MAX_BUILDS_PER_CLIENT} grammars of this client "
                                          "are being compiled; retry once they are done")
                self._per_client[client] = self._per_client.get(client, 0) + 1
            self._building[spec] = done
        self._worker().submit(self._build_into, tokenizer, spec, done, client)
        return done

    def _build_into(self, tokenizer: llg.LLTokenizer, spec: StructuredOutputs, done: Future,
                    client: Optional[str]) -> None:
        """On the compile thread: build `spec`, keep the template (or a `ValueError` refusal) in
        its cache, then settle `done` (anything else raised reaches its waiter, not the thread)."""
        template, error = None, None
        try:
            template = self._build(tokenizer, spec)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        with self._lock:
            del self._building[spec]
            kept = self._cache if error is None else self._refused if isinstance(error, ValueError) else None
            if kept is not None:
                kept[spec] = template if error is None else str(error)
                if len(kept) > GRAMMAR_CACHE_SIZE:
                    kept.popitem(last=False)
            if client is not None:
                left = self._per_client.pop(client) - 1
                if left:
                    self._per_client[client] = left
        if error is None:
            done.set_result(template)
        else:
            done.set_exception(error)

    @staticmethod
    def _build(tokenizer: llg.LLTokenizer, spec: StructuredOutputs) -> llg.LLMatcher:
        """On the compile thread: `spec` measured (`grammar_limits`), then built; `ValueError`s
        that say what is wrong with it (a client's mistake, never the library's backtrace)."""
        try:
            text = _constraint_text(spec)
            if text is not None:
                check_limits(spec.kind, text)
            grammar = grammar_text(spec)
        except RecursionError:
            raise ValueError(f"structured_outputs.{spec.kind}: nested too deep to compile") from None
        except (ValueError, TypeError, AssertionError) as exc:
            message = str(exc)
            raise ValueError(message if message.startswith("structured_outputs")
                             else f"structured_outputs.{spec.kind}: {message}") from None
        template = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: {_first_line(template.get_error())}")
        return template

    _compile_thread: Optional[ThreadPoolExecutor] = None
    _compile_thread_lock = threading.Lock()

    @classmethod
    def _worker(cls) -> ThreadPoolExecutor:
        """The one thread grammars are built on, with `COMPILE_STACK_BYTES` of stack (see
        `grammar_limits`): the library's recursion never reaches the end of a caller's stack."""
        with cls._compile_thread_lock:
            if cls._compile_thread is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
                before = threading.stack_size(COMPILE_STACK_BYTES)
                try:
                    pool.submit(int).result()  # NOTE: the thread starts now, under this stack size
                finally:
                    threading.stack_size(before)
                cls._compile_thread = pool
            return cls._compile_thread

    def precompile(self, params_list) -> None:
        """Compile the constraints of `params_list` (SamplingParams or None) into the cache, on the
        caller's thread; a refusal is left for the engine's own check to raise."""
        for params in params_list:
            spec = getattr(params, "structured_outputs", None)
            if spec is not None and self.available:
                try:
                    self.compile(spec)
                except Exception:  # noqa: BLE001 (each request's own check raises its refusal, alone)
                    pass


class GrammarSlots:
    """One matcher per slot of `slots` slots, and the step's bitmask buffer (`[rows, ceil(V / 32)]`
    int32, grown on demand). Invariant: `matchers[s]` is set iff slot s serves a request with a
    grammar, and has consumed exactly that slot's output tokens."""

    __slots__ = ("matchers", "uses", "vocab_size", "_bitmask", "_executor")

    def __init__(self, slots: int, vocab_size: int) -> None:
        self.matchers: list[llg.LLMatcher | None] = [None] * slots
        self.uses = np.zeros(slots, dtype=bool)
        self.vocab_size = vocab_size
        self._bitmask: Tensor | None = None
        self._executor: llg.LLExecutor | None = None

    def bind(self, slot: int, template: llg.LLMatcher | None, output: np.ndarray) -> None:
        """Slot `slot` now serves a request with grammar `template` (None: unconstrained) and
        `output` tokens so far (after a preemption, the matcher catches up on them)."""
        self.release(slot)
        if template is None:
            return
        matcher = template.deep_copy()
        if len(output):
            matcher.consume_tokens([int(t) for t in output])
        self.matchers[slot] = matcher
        self.uses[slot] = True

    def release(self, slot: int) -> None:
        self.matchers[slot] = None
        self.uses[slot] = False

    def reset(self) -> None:
        for slot in np.flatnonzero(self.uses).tolist():
            self.release(slot)

    def masks(self, slots: np.ndarray) -> tuple[np.ndarray, Tensor] | None:
        """(the batch rows with a grammar, their bitmasks `[G, W]` int32) for a step sampling `slots`;
        None when no row has one."""
        rows = np.flatnonzero(self.uses[slots])
        if rows.size == 0:
            return None
        width = (self.vocab_size + 31) // 32
        have = 0 if self._bitmask is None else len(self._bitmask)
        if have < rows.size:  # NOTE: grown by doubling, never shrunk
            self._bitmask = torch.empty((max(rows.size, 2 * have), width), dtype=torch.int32)
            self._executor = self._executor or llg.LLExecutor(_GRAMMAR_THREADS)
        bitmask = self._bitmask[: rows.size]
        work = [(self.matchers[int(slots[r])], i) for i, r in enumerate(rows.tolist())]
        llg_numpy.fill_next_token_bitmask_par(self._executor, work, bitmask.numpy())
        return rows, bitmask

    def accept(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray | None:
        """Advance each grammar slot of `slots` by its token; returns per row whether its request is
        done (grammar stopped, or the token refused: see module docstring), None if no slot has a
        grammar."""
        if not self.uses.any():  # NOTE: one pass over a few hundred flags; the usual step has no grammar
            return None
        done = np.zeros(slots.size, dtype=bool)
        rows = np.flatnonzero(self.uses[slots])
        for r in rows.tolist():
            matcher = self.matchers[int(slots[r])]
            if not matcher.consume_token(int(tokens[r])):
                logger.warning("structured outputs: token %d refused by the grammar (%s); the request ends",
                               int(tokens[r]), matcher.get_error())
                done[r] = True
            elif matcher.is_stopped():
                done[r] = True
        return done
