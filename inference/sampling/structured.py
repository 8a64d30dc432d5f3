"""Structured outputs: what a request's completion must match (vLLM's `StructuredOutputsParams`).

Exactly one constraint per request: `json` (a JSON schema, as JSON text), `regex`, `choice` (one of
a few strings), `grammar` (Lark, or GBNF / EBNF as llama.cpp writes it), `json_object` (any JSON
object) or `structural_tag` (vLLM's JSON: free text in which each trigger opens a tagged,
schema-constrained part). The options tune the JSON ones: `disable_any_whitespace` (no whitespace
between tokens of the JSON), `whitespace_pattern` (a regex for it instead),
`disable_additional_properties` (objects of the schema that do not say take no other keys).

Validated here for shape only (types, one constraint, sizes); whether the constraint compiles is
the engine's to say, against its tokenizer (`inference.sampling.grammar`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields
from typing import Annotated

from msgspec import Meta

MAX_GRAMMAR_CHARS = 1 << 20  # one constraint's text; a larger one is refused before it is compiled
MAX_CHOICES = 1024


class Constraint(str, enum.Enum):
    """A `StructuredOutputs`' kind of constraint; its value is the field that sets it (and names it
    in messages: `str` gives the value)."""

    JSON = "json"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    JSON_OBJECT = "json_object"
    STRUCTURAL_TAG = "structural_tag"

    def __str__(self) -> str:
        return self.value


CONSTRAINTS = tuple(c.value for c in Constraint)
_Text = Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)]  # a bound the wire checks as it decodes


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One request's output constraint (see module docstring); hashable, so compiled grammars are
    cached by it. `json` given as a dict is kept as its JSON text (key order preserved: it is the
    order the properties are written in)."""

    json: _Text | None = None
    regex: _Text | None = None
    choice: Annotated[tuple[_Text, ...], Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: _Text | None = None
    json_object: bool = False
    structural_tag: _Text | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: _Text | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if isinstance(self.structural_tag, dict):
            object.__setattr__(self, "structural_tag", json.dumps(self.structural_tag))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and len(value) <= MAX_GRAMMAR_CHARS):
                raise ValueError(f"structured_outputs.{name} must be a string of at most {MAX_GRAMMAR_CHARS} "
                                 f"characters, got {type(value).__name__}")
        if self.choice is not None:
            if not (isinstance(self.choice, tuple) and 0 < len(self.choice) <= MAX_CHOICES
                    and all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} strings")
            if sum(map(len, self.choice)) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"structured_outputs.choice: more than {MAX_GRAMMAR_CHARS} characters in all")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag must be set, got {given or 'none'}")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError("structured_outputs: disable_any_whitespace and whitespace_pattern exclude each other")

    @property
    def kind(self) -> Constraint:
        """The constraint that is set."""
        return next(c for c in Constraint if getattr(self, c.value) not in (None, False))

    def as_dict(self) -> dict:
        """The set fields (the wire and the tests)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value not in (None, False):
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out
