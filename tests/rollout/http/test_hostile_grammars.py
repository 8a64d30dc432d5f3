"""Constraints built to break the grammar library, sent to a real `rollout serve --http` process:
`$ref` chains and Lark / GBNF rule chains thousands deep (which overflowed the native stack:
SIGSEGV, the server gone), through `response_format`, `structured_outputs` and a forced tool's
`parameters`; and, over ZMQ, a schema nested hundreds deep sent beside a plain request (a
`RecursionError` used to refuse the whole batch as an internal error). Each is refused alone with
a 4xx naming the limit, and the server then answers a normal generation as before."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from inference import SamplingParams, StructuredOutputs
from tests.rollout.http_util import MODEL, WAIT_S

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DEPTH = 20000


def ref_chain(n: int = DEPTH) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int = DEPTH) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int = DEPTH) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


ATTACKS = {
    "response_format $ref chain": ("/v1/chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain()}}}),
    "structured_outputs lark chain": ("/v1/completions", {"structured_outputs": {"grammar": lark_chain()}}),
    "structured_outputs gbnf chain": ("/v1/completions", {"structured_outputs": {"grammar": gbnf_chain()}}),
    "forced tool $ref chain": ("/v1/chat/completions", {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": ref_chain()}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}),
}


def _baseline(web: httpx.Client) -> list[int]:
    body = {"model": MODEL, "prompt": [1, 2000, 3000], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    reply = web.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_grammar_built_to_overflow_the_stack_is_refused_and_the_server_serves_on(http_server, attack):
    route, extra = ATTACKS[attack]
    with httpx.Client(base_url=http_server.http_url, timeout=WAIT_S) as web:
        before = _baseline(web)
        body = {"model": MODEL, "max_tokens": 4, **extra}
        body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {"prompt": "Hi"})
        reply = web.post(route, json=body)
        assert reply.status_code == 400, reply.text[:500]
        message = reply.json()["error"]["message"]
        assert "at most" in message and "backtrace" not in message.lower(), message
        assert http_server.proc.poll() is None  # the process is alive
        assert _baseline(web) == before


def test_over_zmq_a_schema_nested_hundreds_deep_is_refused_alone(http_server):
    """Sent together with plain requests: the bad one is the client's INVALID_REQUEST, the others
    generate (each request of a batch is admitted or refused alone)."""
    from rollout import AsyncRolloutClient
    from rollout.wire.codec import ProtocolError
    from rollout.wire.kinds import ErrorCode

    bad = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs(json=json.dumps(nested(400))))
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def together():
        async with AsyncRolloutClient(http_server.address, timeout=WAIT_S) as client:
            return await asyncio.gather(client.generate([[1, 2, 3]], 1, plain), client.generate([[1, 2, 3]], 1, bad),
                                        client.generate([[4, 5, 6]], 1, plain), return_exceptions=True)
    first, refused, last = asyncio.run(together())
    assert isinstance(refused, ProtocolError) and refused.code is ErrorCode.INVALID_REQUEST, refused
    assert "structured_outputs" in str(refused)
    assert [len(b.rollouts[0].completion_ids) for b in (first, last)] == [3, 3]


def test_a_grammar_that_compiles_for_seconds_stalls_no_other_client(http_server):
    """A valid schema of 8,000 properties takes seconds to build; it is built off the engine's
    loop, so a plain generation sent after it is answered first (it used to wait behind it)."""
    import concurrent.futures

    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(8000)}}
    schema["properties"] = {**schema["properties"], "z": {"type": "string", "maxLength": 2}}
    big = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "structured_outputs": {"json": schema}}
    plain = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
    order: list[str] = []

    def post(name: str, body: dict) -> int:
        with httpx.Client(base_url=http_server.http_url, timeout=WAIT_S) as web:
            status = web.post("/v1/completions", json=body).status_code
        order.append(name)
        return status
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(post, "schema", big)
        time.sleep(0.3)  # NOTE: the schema's build has started
        fast = pool.submit(post, "plain", plain)
        assert fast.result(WAIT_S) == 200 and slow.result(WAIT_S) == 200
    assert order == ["plain", "schema"]
