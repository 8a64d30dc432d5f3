"""A tool's `parameters` schema made strict, as vLLM's default structured-output backend reads one.

xgrammar (vLLM's default) compiles a JSON schema in strict mode: an object may hold only the
properties its schema lists unless the schema says otherwise, so a forced call cannot invent keys
or repeat one. llguidance (ours) follows JSON Schema, where a missing `additionalProperties` means
any key is allowed, which lets a small model wander through made-up keys and never close the
object. `strict_arguments` writes the strict reading out: every object schema that lists
`properties` and says nothing of `additionalProperties` gets `"additionalProperties": false`,
at any depth (properties, items, combinators, `$defs`); an object schema without `properties` (or
with them empty) stays free-form, as in xgrammar.
"""

from __future__ import annotations

# keywords whose value is one schema, and those whose value is a list / map of schemas
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
        "contains", "propertyNames", "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_arguments(schema: dict) -> dict:
    """`schema` with `"additionalProperties": false` on each object schema that lists properties
    and leaves it unsaid (module docstring). The input is not changed: each schema node on the way
    is copied before it is written. Iterative: a deep schema cannot exhaust the stack here."""
    root = dict(schema)
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node.get("properties"), dict) and node["properties"] and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key, value in list(node.items()):
            if key in _ONE and isinstance(value, dict):
                node[key] = child = dict(value)
                stack.append(child)
            elif key in _LIST and isinstance(value, list):
                node[key] = [dict(v) if isinstance(v, dict) else v for v in value]
                stack.extend(v for v in node[key] if isinstance(v, dict))
            elif key in _MAP and isinstance(value, dict):
                node[key] = {k: dict(v) if isinstance(v, dict) else v for k, v in value.items()}
                stack.extend(v for v in node[key].values() if isinstance(v, dict))
    return root
