"""Structured outputs over HTTP with the official `openai` client and SGLang's JSON: a real
`rollout serve --http` process (the tiny random Llama over SmolLM2's tokenizer), asked on its own
front and on a front over ZMQ (the constraint crosses the wire). What the model writes is checked
by `jsonschema` and `re`, not by the code that constrained it."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.rollout.http_util import MODEL, WAIT_S

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# bounded (enums, short strings), so that a random model's samples end within max_tokens
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", None]}},
    "required": ["name", "age", "pet"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person."}]
COMPACT = {"disable_any_whitespace": True}


@pytest.fixture
def web(front_url):
    with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
        yield c


def chat(oai, **kwargs):
    kwargs.setdefault("max_tokens", 96)
    return oai.chat.completions.create(model=MODEL, messages=ASK, **kwargs)


def test_response_format_json_schema_validates(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = chat(oai, n=4, temperature=1.0, seed=5, response_format=fmt)
    texts = [c.message.content for c in out.choices]
    for c in out.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len(set(texts)) > 1


def test_response_format_json_object_is_an_object(oai):
    out = chat(oai, temperature=0, max_tokens=64, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.lstrip().startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    compact = chat(oai, temperature=0, max_tokens=64, extra_body={"structured_outputs": {"json_object": True,
                                                                                        **COMPACT}})
    assert compact.choices[0].message.content.startswith("{") and " " not in compact.choices[0].message.content[:2]


@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"[A-Z][a-z]{2,6} [0-9]{1,3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{1,3}", t)),
    ({"choice": ["positive", "negative", "neutral"]}, lambda t: t in {"positive", "negative", "neutral"}),
    ({"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'},
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    ({"json": PERSON, **COMPACT}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_vllm_structured_outputs_on_completions_and_chat(oai, constraint, check):
    completion = oai.completions.create(model=MODEL, prompt="Answer:", n=3, temperature=1.0, seed=2, max_tokens=96,
                                        extra_body={"structured_outputs": constraint})
    replies = [(c.text, c.finish_reason) for c in completion.choices]
    replies += [(c.message.content, c.finish_reason) for c in chat(
        oai, n=3, temperature=1.0, seed=3, extra_body={"structured_outputs": constraint}).choices]
    for text, finish in replies:
        assert finish == "stop" and check(text), text


def test_streamed_json_is_the_whole_one(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = chat(oai, temperature=0, response_format=fmt).choices[0].message.content
    stream = chat(oai, temperature=0, response_format=fmt, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == whole
    jsonschema.validate(json.loads(whole), PERSON)


def test_sglang_generate_constraints(web):
    cases = [({"json_schema": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
             ({"regex": "(yes|no)!"}, lambda t: t in {"yes!", "no!"}),
             ({"ebnf": 'root ::= "a" [0-9] [0-9]'}, lambda t: re.fullmatch(r"a[0-9]{2}", t))]
    for constraint, check in cases:
        body = {"text": "Q:", "sampling_params": {"temperature": 0, "max_new_tokens": 96, **constraint}}
        out = web.post("/generate", json=body)
        assert out.status_code == 200, out.text
        reply = out.json()
        assert reply["meta_info"]["finish_reason"]["type"] == "stop" and check(reply["text"]), reply


def refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_bad_constraints_get_vllms_400_naming_the_field(web):
    base = {"model": MODEL, "messages": ASK, "max_tokens": 4}
    message = refused(web.post("/v1/chat/completions", json={**base, "structured_outputs": {"regex": "a("}}),
                      "structured_outputs")
    assert "regex" in message
    refused(web.post("/v1/chat/completions", json={**base, "structured_outputs": {"json": {"type": "nope"}}}),
            "structured_outputs")
    refused(web.post("/v1/chat/completions", json={**base, "structured_outputs": {"regex": "a", "choice": ["b"]}}),
            "structured_outputs")
    refused(web.post("/v1/chat/completions", json={**base, "structured_outputs": {"guided_json": {}}}),
            "structured_outputs.guided_json")
    refused(web.post("/v1/chat/completions", json={**base, "structured_outputs": {"regex": "a"},
                                                    "response_format": {"type": "json_object"}}), "response_format")
    refused(web.post("/v1/chat/completions", json={**base, "response_format": {"type": "json_schema"}}),
            "response_format")
    refused(web.post("/v1/completions", json={"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}}),
            "response_format.type")
    sglang = web.post("/generate", json={"text": "Q:", "sampling_params": {"regex": "a", "ebnf": 'root ::= "b"'}})
    assert sglang.status_code == 400, sglang.text
    # the engine serves on after every refusal
    ok = web.post("/v1/chat/completions", json={**base, "structured_outputs": {"choice": ["fine"]}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


def test_response_format_text_is_no_constraint(oai):
    free = chat(oai, temperature=0, max_tokens=8)
    text = chat(oai, temperature=0, max_tokens=8, response_format={"type": "text"})
    assert free.choices[0].message.content == text.choices[0].message.content


def test_the_openai_sdk_parse_helper(oai):
    """`client.chat.completions.parse` with a pydantic model: the SDK's own strict-schema path."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        pet: Literal["cat", "dog"]

    out = oai.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, temperature=0, max_tokens=64)
    assert isinstance(out.choices[0].message.parsed, Person)
