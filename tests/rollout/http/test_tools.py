"""Tool-call parsers (`rollout.http.core.tools`) on replies as models write them, whole and streamed: a
stream cut anywhere gives the same content and calls as the whole reply."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.http.core.tools import ForcedCallError, ToolChoiceError, ToolParser, ToolPlan, plan_tools, tool_stream

QWEN_TWO_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                  '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
HERMES_CASES = [
    # (reply, content, [(name, arguments as objects)])
    (QWEN_TWO_CALLS, "I will look both up.\n",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "search", "arguments": {"q": "Zürich 東京 😀", "n": 3, "deep": {"a": [1, null]}}}'
     '</tool_call>\nDone: that is all.', "Done: that is all.",
     [("search", {"q": "Zürich 東京 😀", "n": 3, "deep": {"a": [1, None]}})]),
    ('<tool_call>{"name": "noop"}</tool_call>', None, [("noop", {})]),
    ('Calling: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "Calling: ",  # cut by EOS
     [("get_weather", {"city": "Paris"})]),
    ("No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("ends on a half tag <tool_ca", "ends on a half tag <tool_ca", []),
    ('broken <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
     'broken <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>not json</tool_call>\n',
     "<tool_call>not json</tool_call>\n", [("a", {})]),
]
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"s": "x; y"}}; {"name": "b", "arguments": {"k": "ü"}}', None,
     [("a", {"s": "x; y"}), ("b", {"k": "ü"})]),
    ('  \n{"name": "get_weather", "parameters": {"city": "Paris"}}\n', None, [("get_weather", {"city": "Paris"})]),
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
]
CASES = [(ToolParser.HERMES, *c) for c in HERMES_CASES] + [(ToolParser.LLAMA3_JSON, *c) for c in LLAMA_CASES]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[int, dict]]]:
    stream = tool_stream(parser)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        out = stream.feed(piece)
        if i == len(pieces) - 1:
            out += stream.finish()
        content += out.content
        calls += [(index, call.as_delta(index)) for index, call in out.calls]
    return content, calls


def named(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("parser", "reply", "content", "calls"), CASES)
def test_whole_reply(parser, reply, content, calls):
    got_content, got_calls = ToolPlan(parser).parse(reply)
    assert got_content == content
    assert named(got_calls) == calls
    for call in got_calls:
        assert call.id.startswith("call_") and call.as_dict()["type"] == "function"
        assert call.as_dict()["function"]["arguments"] == call.arguments


@pytest.mark.parametrize(("parser", "reply", "content", "calls"), CASES)
def test_split_anywhere_matches_whole(parser, reply, content, calls):
    """Two pieces cut at every character, and one character at a time: the same content and calls,
    each call once, whole (index, id, type, name, arguments), in order."""
    whole_content, whole_calls = ToolPlan(parser).parse(reply)
    cuts = [[reply[:k], reply[k:]] for k in range(len(reply) + 1)] + [list(reply)]
    for pieces in cuts:
        got_content, got_calls = streamed(parser, pieces)
        assert got_content == (whole_content or "")
        assert [i for i, _ in got_calls] == list(range(len(whole_calls)))
        assert [(d["function"]["name"], d["function"]["arguments"], d["type"]) for _, d in got_calls] == \
            [(c.name, c.arguments, "function") for c in whole_calls]


def test_held_back_until_known():
    """A tail that could open `<tool_call>` is not shown until the text rules it out."""
    stream = tool_stream(ToolParser.HERMES)
    assert stream.feed("Sure <tool").content == "Sure "
    assert stream.feed("box").content == "<toolbox"
    assert stream.feed(" <tool_call>{\"name\": \"f\", ").content == " "
    out = stream.feed('"arguments": {}}</tool_call>')
    assert out.content == "" and [c.name for _, c in out.calls] == ["f"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 400), max_size=12))
def test_any_partition_matches_whole(case, cuts):
    parser, reply, _, _ = case
    points = sorted({c % (len(reply) + 1) for c in cuts})
    pieces = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)])]
    whole_content, whole_calls = ToolPlan(parser).parse(reply)
    got_content, got_calls = streamed(parser, pieces)
    assert got_content == (whole_content or "")
    assert [d["function"]["arguments"] for _, d in got_calls] == [c.arguments for c in whole_calls]


def test_no_parser_keeps_text():
    assert tool_stream(ToolParser.NONE) is None
    assert ToolPlan(ToolParser.NONE).parse(QWEN_TWO_CALLS) == (QWEN_TWO_CALLS, [])


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_tool_choice():
    hermes = ToolParser.HERMES
    assert plan_tools(None, WEATHER, hermes) == ToolPlan(hermes) == plan_tools("auto", WEATHER, hermes)
    assert plan_tools(None, None, hermes) == ToolPlan() == plan_tools("none", WEATHER, hermes)
    assert plan_tools("required", [], hermes) == ToolPlan()  # OpenAI: nothing to call, nothing required
    for choice, words in [({"type": "function", "function": {"name": "other"}}, "does not match"),
                          ({"type": "function"}, "named tool choice")]:
        with pytest.raises(ToolChoiceError, match=words):
            plan_tools(choice, WEATHER, hermes)
    with pytest.raises(ToolChoiceError, match="`tools` must be set"):
        plan_tools("required", None, hermes)


TWO_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                 "type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}, "required": ["city"],
                 "$defs": {"city": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "get_time"}}]


def test_forced_calls_are_json_under_a_schema_and_parse_back():
    """Named: the arguments alone, one call of that function, finish "stop". Required: a list of
    {name, parameters}, each one of the tools ($defs hoisted to the top), finish "tool_calls"."""
    import jsonschema

    named = plan_tools({"type": "function", "function": {"name": "get_weather"}}, TWO_TOOLS, ToolParser.NONE)
    assert named.named == "get_weather" and named.forced.kind == "json"
    content, calls = named.parse('{"city": "Paris"}')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert named.finish_reason(True, "stop") == "stop"
    required = plan_tools("required", TWO_TOOLS, ToolParser.HERMES)
    schema = json.loads(required.forced.json)
    reply = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(reply, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"city": 3}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls = required.parse(json.dumps(reply))
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"} and required.finish_reason(True, "stop") == "tool_calls"
    with pytest.raises(ForcedCallError, match="names no call: it is not JSON"):  # several tools: no name to give
        required.parse('[{"name": "get_weather", "param')
    lone = plan_tools("required", TWO_TOOLS[:1], ToolParser.NONE)
    cut = '[{"name": "get_weather", "param'
    content, calls = lone.parse(cut)  # one tool: its call, the text as arguments
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", cut)]
    content, calls = named.parse('{"city": "Par')  # vLLM's: a named call's text is its arguments, parsed or not
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Par')]
    single = json.loads(plan_tools("required", TWO_TOOLS, ToolParser.NONE, parallel_tool_calls=False).forced.json)
    assert single["maxItems"] == 1


def test_front_config_names_the_field():
    from rollout.http.core.front import FrontConfig

    assert FrontConfig("m", 64, tool_parser="hermes").tool_parser is ToolParser.HERMES
    with pytest.raises(ValueError, match="FrontConfig.tool_parser must be one of none, hermes, llama3_json"):
        FrontConfig("m", 64, tool_parser="mistral")


def test_cli_flag():
    import argparse

    from rollout.server.serve import add_http_arguments

    parser = argparse.ArgumentParser()
    add_http_arguments(parser)
    base = ["--connect", "tcp://127.0.0.1:1", "--model", "m"]
    assert parser.parse_args(base).tool_call_parser == "none"
    assert parser.parse_args([*base, "--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = plan_tools("auto", WEATHER, ToolParser.HERMES, parallel_tool_calls=False)
    content, calls = plan.parse(QWEN_TWO_CALLS)
    assert content == "I will look both up.\n" and [c.name for c in calls] == ["get_weather"]
    assert [c.name for c in plan_tools("auto", WEATHER, ToolParser.HERMES).parse(QWEN_TWO_CALLS)[1]] == \
        ["get_weather", "get_time"]


def test_arguments_are_strict_as_vllms_xgrammar_reads_them():
    """Every object schema that lists properties and leaves `additionalProperties` unsaid admits
    only those, at any depth; one that says it, or lists none, is left as it is; the tool's own
    schema is not changed."""
    from rollout.http.core.tool_schema import strict_arguments

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {"y": {}}}, {"type": "null"}]}},
        "c": {"type": "object"}, "d": {"type": "object", "properties": {"z": {}}, "additionalProperties": True},
        "e": {"$ref": "#/$defs/e"}}, "$defs": {"e": {"type": "object", "properties": {"w": {}}}}}
    before = json.dumps(schema)
    strict = strict_arguments(schema)
    assert json.dumps(schema) == before
    props = strict["properties"]
    assert strict["additionalProperties"] is False and props["a"]["additionalProperties"] is False
    assert props["b"]["items"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["c"] and props["d"]["additionalProperties"] is True
    assert strict["$defs"]["e"]["additionalProperties"] is False
    deep = inner = {}
    for _ in range(5000):  # deeper than Python's recursion limit: the walk is iterative
        inner["properties"] = {"p": {}}
        inner = inner["properties"]["p"]
    node = strict_arguments(deep)
    for _ in range(5000):
        assert node["additionalProperties"] is False
        node = node["properties"]["p"]
    named = plan_tools({"type": "function", "function": {"name": "get_weather"}}, TWO_TOOLS, ToolParser.NONE)
    assert json.loads(named.forced.json)["additionalProperties"] is False
