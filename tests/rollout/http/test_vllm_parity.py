"""Where vLLM's own clients look, the served front answers as vLLM does: wake-ups sent together,
a pause or resume of a sleeping engine, `usage.prompt_tokens_details.cached_tokens`. Through a
real `rollout serve --http` process: its own front and one over ZMQ to it (`front_url`)."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.rollout.http_util import MODEL, WAIT_S

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BLOCK = 4  # HTTP_SERVER_ARGS' --block-size
TOGETHER = 8


@pytest.fixture
def web(front_url):
    with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
        yield c
        c.post("/wake_up")
        c.post("/resume")


def _generate(web: httpx.Client) -> httpx.Response:
    body = {"token_ids": [1, 2000, 3000], "sampling_params": {"temperature": 0, "max_tokens": 3, "ignore_eos": True}}
    return web.post("/inference/v1/generate", json=body)


def _all_at_once(front_url: str, path: str, count: int) -> list[httpx.Response]:
    """`count` POSTs of `path`, each on its own connection, released together by a barrier."""
    barrier = threading.Barrier(count)

    def post(_: int) -> httpx.Response:
        with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
            barrier.wait(WAIT_S)
            return c.post(path)
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(post, range(count)))


def test_wake_ups_sent_together_after_a_sleep_all_answer_200(web, front_url):
    """SkyRL sends a wake-up to every URL of a server at once: each answers 200, as vLLM's."""
    for _ in range(3):
        assert web.post("/sleep", params={"level": 1}).status_code == 200
        assert web.get("/is_sleeping").json() == {"is_sleeping": True}
        replies = _all_at_once(front_url, "/wake_up", TOGETHER)
        assert [r.status_code for r in replies] == [200] * TOGETHER, [r.text for r in replies]
        assert web.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _generate(web).status_code == 200
    replies = _all_at_once(front_url, "/wake_up", TOGETHER)  # awake already: 200 too
    assert [r.status_code for r in replies] == [200] * TOGETHER


def test_pause_and_resume_of_a_sleeping_engine_answer_200_and_hold_after_the_wake_up(web):
    """vLLM's `/pause` and `/resume` answer 200 on a sleeping engine; the engine wakes up paused
    or running as the last of them said."""
    assert web.post("/sleep", params={"level": 1}).status_code == 200
    paused = web.post("/pause", params={"mode": "keep"})
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    assert web.get("/is_sleeping").json() == {"is_sleeping": True}
    assert web.post("/wake_up").status_code == 200
    assert web.get("/is_paused").json() == {"is_paused": True}
    assert web.post("/resume").json() == {"status": "resumed"}
    assert web.get("/is_paused").json() == {"is_paused": False}

    assert web.post("/pause", params={"mode": "abort"}).status_code == 200
    assert web.post("/sleep", params={"level": 1}).status_code == 200
    resumed = web.post("/resume")
    assert resumed.status_code == 200 and resumed.json() == {"status": "resumed"}
    assert web.get("/is_sleeping").json() == {"is_sleeping": True}  # a resume does not wake it
    assert web.post("/wake_up").status_code == 200
    assert web.get("/is_paused").json() == {"is_paused": False}
    assert _generate(web).status_code == 200


def _cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def test_cached_tokens_per_prompt_as_vllm_reports_them(oai, front_url):
    """A repeated prompt of several blocks reports the tokens its prefix cache served, once per
    prompt whatever `n`, never above `prompt_tokens`; a fresh one reports 0. Streaming too."""
    rng = random.Random(front_url)
    prompt = [rng.randrange(100, 40000) for _ in range(6 * BLOCK + 3)]
    fresh = oai.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=2, temperature=1.0)
    assert fresh.usage.prompt_tokens == len(prompt) and _cached(fresh) == 0
    again = oai.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=2, temperature=1.0)
    assert again.usage.prompt_tokens == len(prompt)
    assert 2 * BLOCK < _cached(again) <= len(prompt)
    assert _cached(again) == (len(prompt) - 1) // BLOCK * BLOCK  # every full block but the last token's

    chunks = list(oai.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=2, stream=True,
                                         stream_options={"include_usage": True}))
    assert _cached(chunks[-1]) == _cached(again)
    messages = [{"role": "user", "content": " ".join(str(t) for t in prompt)}]
    chat = [oai.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=2) for _ in range(2)]
    assert _cached(chat[0]) == 0 and 2 * BLOCK < _cached(chat[1]) <= chat[1].usage.prompt_tokens


def test_after_a_deep_sleep_health_and_server_info_say_it_and_the_sdk_does_not_retry(web, front_url, model_dir):
    """After a level-2 sleep and wake-up the engine refuses generations until a weight update
    (its weights are gone); `/health` stays 200 (alive) with a body that says so, `/server_info`
    too, and the refusal is a 503 the openai SDK does not retry (`x-should-retry: false`)."""
    import openai

    assert web.get("/health").content == b""
    assert web.post("/sleep", params={"level": 2}).status_code == 200
    assert web.post("/wake_up").status_code == 200
    health = web.get("/health")
    assert health.status_code == 200 and health.json()["generating"] is False
    assert "deep sleep" in health.json()["reason"]
    engine = web.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]["rollout_engine"]
    assert engine["generating"] is False and "deep sleep" in engine["serving_error"]

    sent = []
    with httpx.Client(event_hooks={"request": [sent.append]}) as http:
        client = openai.OpenAI(base_url=f"{front_url}/v1", api_key="unused", timeout=WAIT_S, max_retries=5,
                               http_client=http)
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    assert refused.value.status_code == 503 and len(sent) == 1  # asked once, never retried
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert "deep sleep" in refused.value.message

    loaded = web.post("/update_weights_from_disk", json={"model_path": str(model_dir)})
    assert loaded.status_code == 200, loaded.text
    assert web.get("/health").content == b"" and _generate(web).status_code == 200
    engine = web.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]["rollout_engine"]
    assert engine["generating"] is True and engine["serving_error"] is None


BOUNDED = {"type": "object", "properties": {
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "unit": {"enum": ["c", "f", "k"]},
    "city": {"type": "string", "maxLength": 6},
    "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                                "tag": {"$ref": "#/$defs/tag"}}},
}, "required": ["count", "unit", "city"], "$defs": {"tag": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4}}, "required": ["name"]}}}
FORCED = [{"type": "function", "function": {"name": "measure", "parameters": BOUNDED}},
          {"type": "function", "function": {"name": "noop"}}]


def _only_listed_keys(value, schema, defs) -> None:
    """Every object in `value` holds only the keys its schema lists (nested objects and `$ref`s too)."""
    schema = defs[schema["$ref"].rsplit("/", 1)[-1]] if "$ref" in schema else schema
    if "properties" in schema:
        assert isinstance(value, dict) and set(value) <= set(schema["properties"]), (value, schema)
        assert set(schema.get("required", ())) <= set(value)
        for key, item in value.items():
            _only_listed_keys(item, schema["properties"][key], defs)


def test_forced_calls_of_a_random_model_hold_only_the_listed_keys(oai):
    """As vLLM's default backend (xgrammar, strict) constrains them: a schema that leaves
    `additionalProperties` unsaid still admits only its listed keys, each once, so even an
    untrained model closes the object and the call parses, named and "required"."""
    import json

    import jsonschema

    choices = [{"type": "function", "function": {"name": "measure"}}, "required"]
    for seed, tool_choice in enumerate(choices * 2):
        reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Measure it."}],
                                            tools=FORCED, tool_choice=tool_choice, parallel_tool_calls=False,
                                            n=3, temperature=1.0, seed=seed, max_tokens=120)
        for choice in reply.choices:
            [call] = choice.message.tool_calls
            arguments = json.loads(call.function.arguments)
            if call.function.name == "noop":
                assert arguments == {} and tool_choice == "required"
                continue
            assert call.function.name == "measure" and choice.message.content == ""
            jsonschema.validate(arguments, BOUNDED)
            _only_listed_keys(arguments, BOUNDED, BOUNDED["$defs"])


def test_a_named_call_that_does_not_parse_is_still_the_call(oai):
    """Cut short by `max_tokens`, a named call's text comes back as its `arguments` (vLLM's
    answer), never as `content`; "required" with one tool answers that tool's name too."""
    messages = [{"role": "user", "content": "Measure it."}]
    named = oai.chat.completions.create(model=MODEL, messages=messages, tools=FORCED[:1], max_tokens=3,
                                        tool_choice={"type": "function", "function": {"name": "measure"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "measure" and call.function.arguments.startswith("{")
    assert named.choices[0].message.content == "" and named.choices[0].finish_reason == "length"
    required = oai.chat.completions.create(model=MODEL, messages=messages, tools=FORCED[:1], max_tokens=3,
                                           tool_choice="required")
    [call] = required.choices[0].message.tool_calls
    assert call.function.name == "measure" and call.function.arguments.startswith("[")
