"""What a structured-output constraint may ask of the grammar library before it is compiled.

llguidance builds a grammar by recursion on the native stack: a JSON schema whose `$ref`s chain a
few thousand definitions deep, or a Lark / GBNF grammar whose rules chain as deep, overflows an
8 MiB stack and kills the process (SIGSEGV: every client's work lost), and a 2 MiB thread stack
(Python's default where the stack limit is unlimited) overflows at a thousand. So every constraint
is measured here first, without recursion of its own, and refused (`ValueError`, a client's 400)
past these bounds; what passes is compiled on a thread with `COMPILE_STACK_BYTES` of stack, many
times what the bounds can use (about 4 KiB of native stack per level, measured).

Every constraint's text is at most `structured.MAX_GRAMMAR_CHARS` (checked when it is made); then

* a JSON schema: at most `MAX_SCHEMA_DEPTH` levels, counted along nesting and `$ref`s together
  (a reference to a definition continues from it; a cycle, a recursive schema, is compiled once
  by the library and counts once);
* a Lark / GBNF grammar: at most `MAX_GRAMMAR_BYTES` and `MAX_GRAMMAR_RULES` rule definitions
  (a chain of rules is at most as long as there are rules);
* a regex: at most `MAX_GRAMMAR_BYTES`; a structural tag's schemas are measured as schemas, its
  grammars as grammars.
"""

from __future__ import annotations

import json
import re
from typing import Any

from inference.sampling.structured import Constraint

MAX_SCHEMA_DEPTH = 1024
MAX_GRAMMAR_BYTES = 256 << 10
MAX_GRAMMAR_RULES = 4096
COMPILE_STACK_BYTES = 256 << 20  # virtual; pages are touched only as deep as a compile goes

# a rule or terminal defined at the start of a line: Lark's `name:` / `NAME.2:` / `?name:`, GBNF's `name ::=`
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w]*(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)
_GBNF_RULE = re.compile(r"::=")


def check_limits(kind: Constraint | str, text: str) -> None:
    """Refuse (`ValueError` naming the bound) a constraint of `kind` whose `text` (a schema's JSON,
    a grammar, a regex, a choice list, a structural tag) is past what may be compiled."""
    kind = Constraint(kind)  # NOTE: its name is taken too
    if kind in (Constraint.JSON, Constraint.STRUCTURAL_TAG):
        try:
            doc = json.loads(text)
        except RecursionError:
            raise ValueError(f"structured_outputs.{kind}: nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError:
            return  # NOTE: not JSON: the compiler's own message says so
        schemas = [doc] if kind is Constraint.JSON else [s.get("schema") for s in _structures(doc)]
        for schema in schemas:
            if isinstance(schema, str):
                check_limits(Constraint.GRAMMAR, schema)
            elif (depth := schema_depth(schema)) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"structured_outputs.{kind}: the schema is {depth} levels deep (nesting and $ref "
                                 f"chains together); at most {MAX_SCHEMA_DEPTH} are compiled")
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise ValueError(f"structured_outputs.{kind}: {size} bytes; at most {MAX_GRAMMAR_BYTES} are compiled")
    if kind is Constraint.GRAMMAR:
        rules = len(_LARK_RULE.findall(text)) + len(_GBNF_RULE.findall(text))
        if rules > MAX_GRAMMAR_RULES:
            raise ValueError(f"structured_outputs.grammar: {rules} rules; at most {MAX_GRAMMAR_RULES} are compiled")


def _structures(tag: Any) -> list[dict]:
    structures = tag.get("structures") if isinstance(tag, dict) else None
    return [s for s in structures if isinstance(s, dict)] if isinstance(structures, list) else []


def schema_depth(schema: Any) -> int:
    """Levels of `schema`, a JSON document, along nesting and local `$ref`s ("#", "#/$defs/x",
    any JSON pointer into the document): each reference continues at its target; a reference back
    to a node on the current path (recursion) adds nothing. Iterative, each node measured once."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, list[Any], int]] = [(schema, _children(schema, schema), 0)]
    on_path.add(id(schema))
    while stack:
        node, children, best = stack[-1]
        if children:
            child = children.pop()
            key = id(child)
            if key in depth:
                stack[-1] = (node, children, max(best, depth[key]))
            elif key not in on_path:
                on_path.add(key)
                stack.append((child, _children(child, schema), 0))
            continue
        stack.pop()
        on_path.discard(id(node))
        depth[id(node)] = best + 1
        if stack:
            parent, rest, parent_best = stack[-1]
            stack[-1] = (parent, rest, max(parent_best, best + 1))
    return depth[id(schema)]


def _children(node: Any, root: Any) -> list[Any]:
    if isinstance(node, list):
        return [v for v in node if isinstance(v, (dict, list))]
    if not isinstance(node, dict):
        return []
    out = [v for v in node.values() if isinstance(v, (dict, list))]
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = _pointer(root, ref[1:])
        if isinstance(target, (dict, list)):
            out.append(target)
    return out


def _pointer(root: Any, pointer: str) -> Any:
    """The node a JSON pointer (`/a/b~1c/0`) names in `root`, or None."""
    node = root
    for part in pointer.split("/")[1:] if pointer else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
