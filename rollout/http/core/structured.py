"""Structured outputs over HTTP: each API's way of asking, as the engine's `StructuredOutputs`.

* vLLM's `structured_outputs` (completions and chat): its fields one to one;
* OpenAI's `response_format`: `text` (no constraint), `json_object`, `json_schema` (its `schema`),
  and vLLM's `structural_tag` (`structures` and `triggers`);
* SGLang's `sampling_params`: `json_schema` (JSON text), `regex`, `ebnf` (a grammar, Lark or
  GBNF), `structural_tag` (JSON text);
* a forced tool call (`tool_choice` "required" or a named function): `rollout.http.core.tools` builds
  its constraint, which takes the place of the others.
At most one per request, as vLLM allows one constraint: a second is a 400 naming it. Whether a
constraint compiles is the engine's to say (a 400 naming `structured_outputs` from its refusal).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from inference import StructuredOutputs
from rollout.http.core.errors import APIError


def from_openai(body: Any, forced: Optional[StructuredOutputs] = None) -> Optional[StructuredOutputs]:
    """The constraint of a completions or chat body; `forced`: a forced tool call's."""
    asked = []
    if body.structured_outputs is not None:
        so = body.structured_outputs
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": bool(so.json_object), "structural_tag": so.structural_tag,
                  "disable_any_whitespace": so.disable_any_whitespace,
                  "disable_additional_properties": so.disable_additional_properties,
                  "whitespace_pattern": so.whitespace_pattern}
        asked.append(("structured_outputs", fields))
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf.type == "json_schema":
            asked.append(("response_format", {"json": json.dumps(rf.json_schema.json_schema)}))
        else:
            tag = {"structures": rf.structures, "triggers": rf.triggers}
            asked.append(("response_format", {"structural_tag": json.dumps(tag)}))
    if forced is not None:
        if asked:
            raise APIError(400, f"`tool_choice` forcing a call cannot be combined with `{asked[0][0]}`: both "
                                "constrain the reply.", param="tool_choice")
        return forced
    if len(asked) > 1:
        raise APIError(400, "Set `structured_outputs` or `response_format`, not both: a reply follows one "
                            "constraint.", param="response_format")
    if not asked:
        return None
    param, fields = asked[0]
    return make(param, **fields)


SGLANG_CONSTRAINTS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar", "structural_tag": "structural_tag"}


def from_sglang(sampling: Any) -> Optional[StructuredOutputs]:
    """The constraint of SGLang `sampling_params` (at most one of its four fields)."""
    given = [name for name in SGLANG_CONSTRAINTS if getattr(sampling, name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"Only one of json_schema, regex, ebnf, structural_tag may be set, got {given}.",
                       param=given[1])
    return make(given[0], **{SGLANG_CONSTRAINTS[given[0]]: getattr(sampling, given[0])})


def make(param: str, **fields: Any) -> StructuredOutputs:
    """`StructuredOutputs(**fields)`, a refusal being a 400 naming `param`."""
    try:
        return StructuredOutputs(**fields)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from None
