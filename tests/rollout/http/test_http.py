"""The HTTP front end to end: a real `rollout serve --http` process on loopback (a tiny random Llama
with SmolLM2's tokenizer and chat template), driven by the official `openai` client and by httpx
with the JSON shapes of SGLang's documentation (`rollout.http.sglang.sglang_routes.SGLANG_API_VERSION`).

The front tests run twice (`front`): on the process's own front, which calls its engine in process
(`InProcessClient`), and on a front in this test process connected to the same server over ZMQ
(`ServiceClient`, what `rollout http --connect` runs): the answers must not tell them apart.

The server is shared by this module; every test leaves it unpaused. The weight-update cycle runs
last and puts the original weights back.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from inference import DynamicInferenceEngine, SamplingParams
from rollout.http.sglang.sglang_routes import SGLANG_API_VERSION
from tests.rollout.http_util import MAX_LEN, MODEL, WAIT_S, engine_config, save_tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference(model_dir):
    return DynamicInferenceEngine.from_pretrained(model_dir, engine_config())


@pytest.fixture
def web(front_url):
    with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
        yield c


def greedy_ids(engine, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([prompt], [params], timeout=WAIT_S)[0].generated_token_ids


# ---- the official openai client --------------------------------------------------------------------


def test_models_and_completion_equal_the_in_process_engine(oai, codec, reference):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    out = oai.completions.create(model=MODEL, prompt="The weather today is", max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})
    choice = out.choices[0]
    prompt = codec.encode("The weather today is")
    assert choice.prompt_token_ids == prompt  # vLLM's return_token_ids names, on every choice
    assert choice.token_ids == greedy_ids(reference, prompt, 6)
    assert choice.text == codec.decode(choice.token_ids)
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 6)


def test_token_in_completions_n_and_logprobs(oai, reference):
    prompts = [[1, 400, 500, 600], [7, 8, 9]]
    out = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=3, temperature=1.0, seed=5,
                                 logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        assert c.prompt_token_ids == prompts[c.index // 3]
        assert len(c.token_ids) == 4 and len(c.logprobs.token_logprobs) == 4
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(len(top) in (2, 3) for top in c.logprobs.top_logprobs)  # the 2 best and the sampled token
        assert all(tok in top for tok, top in zip(c.logprobs.tokens, c.logprobs.top_logprobs))
    again = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=3, temperature=1.0, seed=5,
                                   extra_body={"ignore_eos": True})
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]  # seeded: reproducible
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 24


def test_echo_and_prompt_logprobs_equal_the_engine_on_both_fronts(oai, codec, reference):
    prompt = codec.encode("Rain again in")
    want = reference.generate([prompt], [SamplingParams(max_tokens=1, prompt_logprobs=0)], timeout=WAIT_S)[0]
    out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                                 extra_body={"prompt_logprobs": 0})
    c = out.choices[0]
    assert c.text == codec.decode(prompt) and c.token_ids == [] and c.finish_reason == "length"
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    engine = [want.prompt_logprobs[i][t] for i, t in enumerate(prompt) if i]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(engine, abs=1e-6)
    entries = c.model_extra["prompt_logprobs"]
    assert entries[0] is None and [e[str(t)]["logprob"] for e, t in zip(entries[1:], prompt[1:])] == \
        pytest.approx(engine, abs=1e-6)


def test_sampling_extras_cross_both_fronts(web):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"42": 100}, "cache_salt": "run-1", "repetition_penalty": 1.0, "min_tokens": 1}
    assert web.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == [42] * 3


def test_chat_completion_with_logprobs_and_n(oai, codec, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    out = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, n=2,
                                      logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    prompt = codec.chat_ids(messages)
    assert out.model_extra["prompt_token_ids"] == prompt
    want = greedy_ids(reference, prompt, 5)
    for c in out.choices:
        assert c.model_extra["token_ids"] == want and c.message.role == "assistant"
        assert c.message.content == codec.decode(want)
        content = c.logprobs.content
        assert [t.token for t in content] == codec.token_texts(want)
        # NOTE: greedy: the best alternative is the chosen token, its log-prob rounded in another order
        # (max - (max + log Z) vs -log Z): two half-ulps at most, 9.5e-7 for |log p| in [8, 16) (49k tokens)
        assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)


def test_streaming_chat_and_completion(oai, codec, reference):
    messages = [{"role": "user", "content": "Count to three."}]
    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, ids, finish, usage, chunks = "", [], None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            ids += c.model_extra["token_ids"]
            finish = c.finish_reason or finish
    want = greedy_ids(reference, codec.chat_ids(messages), 12)
    assert ids == want and text == codec.decode(want) and finish == "length"
    assert chunks >= 4 and usage.completion_tokens == 12  # token by token, then the usage chunk
    parts = list(oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}))
    assert sum((p.choices[0].model_extra["token_ids"] for p in parts), []) == greedy_ids(reference, [5, 6, 7], 5)


def test_stop_strings_cut_text_and_ids(oai, codec, reference):
    prompt = [1, 2000, 3000]
    full = greedy_ids(reference, prompt, 12)
    text = codec.decode(full)
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from the middle
    for stream in (False, True):
        out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                     stream=stream, extra_body={"ignore_eos": True})
        chunks = list(out) if stream else [out]
        got = "".join(c.choices[0].text for c in chunks)
        ids = sum((c.choices[0].model_extra["token_ids"] for c in chunks), [])
        assert got == text[:text.index(stop)]
        assert ids == full[:len(ids)] and stop in codec.decode(ids) and stop not in codec.decode(ids[:-1])
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_rollout_client_takes_text_and_chat_prompts(http_server, model_dir, codec):
    from rollout import RolloutClient

    chat = [{"role": "user", "content": "Hello!"}]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with RolloutClient(http_server.address, timeout=WAIT_S, tokenizer=model_dir) as client:
        by_text = client.generate(["Once upon a time", chat], sampling=greedy)
        by_ids = client.generate([codec.encode("Once upon a time"), codec.chat_ids(chat)], sampling=greedy)
    assert [r.completion_ids for r in by_text] == [r.completion_ids for r in by_ids]
    assert [r.text for r in by_text] == [codec.decode(r.completion_ids) for r in by_ids]


# ---- bad input: OpenAI's status codes and error bodies; the server keeps serving -------------------


def test_bad_requests_are_answered_like_openai(oai, web):
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="gpt-nope", prompt="x", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"frobnicate": 1})
    assert err.value.body["message"] == "Unrecognized request argument supplied: frobnicate"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=3.5)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt=[7] * (MAX_LEN - 2), max_tokens=10)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt=[10**6], max_tokens=1)  # outside the vocabulary
    for raw in (b'{"model": "tiny-chat", "prompt": ', b"[1, 2]", b"\xff\xfe"):
        r = web.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = web.post("/v1/nope", json={})
    assert r.status_code == 404 and "error" in r.json()
    r = web.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "bogus": 1}})
    assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400
    r = web.post("/generate", json={"text": "x", "input_ids": [1]})
    assert r.status_code == 400
    ok = oai.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2)
    assert len(ok.choices[0].token_ids) >= 1  # still serving


# ---- SGLang's native routes ----------------------------------------------------------------------


def test_sglang_generate_shapes(web, codec, reference):
    """`/generate` as SGLang documents it (pinned to SGLang's docs, SGLANG_API_VERSION)."""
    assert SGLANG_API_VERSION == "0.5.6"
    r = web.post("/generate", json={"text": "The capital of France is",
                                    "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
                                    "return_logprob": True, "top_logprobs_num": 2, "rid": "req-1"})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    want = greedy_ids(reference, codec.encode("The capital of France is"), 5)
    assert out["output_ids"] == want and out["text"] == codec.decode(want)
    assert meta["id"] == "req-1" and meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(codec.encode("The capital of France is")) and meta["completion_tokens"] == 5
    assert meta["weight_version"] == web.get("/get_weight_version").json()["weight_version"]
    assert [(t[1], t[2]) for t in meta["output_token_logprobs"]] == [(t, None) for t in want]
    assert all(len(top) == 2 and len(top[0]) == 3 for top in meta["output_top_logprobs"])
    batch = web.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]],
                                        "sampling_params": {"temperature": 0, "max_new_tokens": 3, "n": 2,
                                                            "ignore_eos": True}}).json()
    assert [o["output_ids"] for o in batch] == [greedy_ids(reference, [1, 2, 3], 3)] * 2 + \
        [greedy_ids(reference, [4, 5], 3)] * 2
    events = []
    with web.stream("POST", "/generate", json={"input_ids": [9, 10, 11], "stream": True,
                                               "sampling_params": {"temperature": 0, "max_new_tokens": 4,
                                                                   "ignore_eos": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == greedy_ids(reference, [9, 10, 11], 4) and last["meta_info"]["finish_reason"]
    assert all(json.loads(e)["meta_info"]["finish_reason"] is None for e in events[:-2])


def test_sglang_health_and_info(web):
    assert web.get("/health").status_code == 200
    assert web.get("/health_generate").status_code == 200
    info = web.get("/get_model_info").json()
    assert info["is_generation"] is True and set(info) >= {"model_path", "tokenizer_path", "weight_version"}


def test_in_place_pause_keeps_kv_so_flush_cache_is_refused(web, front_url):
    body = {"input_ids": [3, 4, 5], "stream": True, "rid": "long",
            "sampling_params": {"max_new_tokens": MAX_LEN - 8, "ignore_eos": True}}
    with httpx.Client(base_url=front_url, timeout=WAIT_S) as other:
        with other.stream("POST", "/generate", json=body) as s:
            lines = s.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[len("data: "):])["meta_info"]["finish_reason"] is None  # it runs: it holds KV
            try:
                assert web.post("/pause_generation", json={"mode": "in_place"}).json() == {
                    "message": "Generation paused successfully.", "status": "ok"}
                assert web.post("/flush_cache", json={}).status_code == 400  # SGLang refuses it too
                assert web.post("/abort_request", json={"rid": "long"}).status_code == 200
                events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
            finally:
                web.post("/continue_generation", json={})
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "abort"
    assert web.post("/flush_cache", json={}).status_code == 200  # nothing holds KV now


def test_three_turn_agent_session_keeps_sampled_ids(oai, web, codec):
    """Turn k+1's prompt ids start with turn k's prompt ids + sampled ids, verbatim, and turns 2 and
    3 are served from the prefix cache; re-tokenizing the text would have changed the ids."""
    session = {"X-Session-ID": "agent-7"}
    messages = [{"role": "system", "content": "You are a weather agent. Call tools as <tool_call>{json}</tool_call>."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    later = [[{"role": "tool", "content": '{"name": "get_weather", "content": {"city": "Paris", "temp_c": 21}}'}],
             [{"role": "user", "content": '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'}]]
    turns, cached = [], []
    for k in range(3):
        before = web.get("/get_server_info").json()["internal_states"][0]["engine/prefix_cached_tokens"]
        out = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=11 + k,
                                          extra_headers=session, extra_body={"ignore_eos": True})
        after = web.get("/get_server_info").json()["internal_states"][0]["engine/prefix_cached_tokens"]
        prompt, sampled = out.model_extra["prompt_token_ids"], out.choices[0].model_extra["token_ids"]
        turns.append((prompt, sampled, out.choices[0].message.content))
        cached.append(after - before)
        if k < 2:
            messages = messages + [{"role": "assistant", "content": out.choices[0].message.content}] + later[k]
    for (p0, s0, _), (p1, _, _) in zip(turns, turns[1:]):
        assert p1[:len(p0) + len(s0)] == p0 + s0
        assert len(p1) > len(p0) + len(s0)
    # a sampled completion whose text tokenizes to other ids: re-tokenizing the history would drift
    assert any(codec.encode(text, add_special_tokens=False) != sampled for _, sampled, text in turns[:2])
    assert codec.chat_ids(messages) != turns[2][0]
    for k in (1, 2):  # the whole previous turn, but its last partial block, comes from the cache
        assert cached[k] >= len(turns[k - 1][0]) + len(turns[k - 1][1]) - 4, cached
    sessions = web.get("/get_server_info").json()["sessions"]
    assert sessions["continued"] >= 2


def test_a_suspended_engine_refuses_generation_with_the_same_error(web):
    """The engine's typed refusal reaches HTTP as the same status and message on either front: 503
    with Retry-After while suspended (a state, not the request's fault); resuming a running engine is
    SGLang's 400."""
    assert web.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    try:
        r = web.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "suspended" in r.json()["error"]["message"], r.text
        assert r.headers["retry-after"] == "1"
        r = web.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_unavailable") and "retry-after" in r.headers
        assert web.get("/health").status_code == 200  # suspended is not unhealthy
    finally:
        assert web.post("/resume_memory_occupation", json={}).status_code == 200
    again = web.post("/resume_memory_occupation", json={})
    assert again.status_code == 400 and again.json()["error"]["message"], again.text
    assert web.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).is_success


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_client_gone_before_its_answer_aborts_its_samples(front_url, web, path):
    """A non-streaming request whose client disconnects is aborted: its KV blocks are freed long
    before its samples could have finished, and they stop short of their budget."""
    def figures() -> dict:
        return web.get("/get_server_info").json()["internal_states"][0]

    n, budget = 4, MAX_LEN - 40
    common = {"model": MODEL, "max_tokens": budget, "n": n, "ignore_eos": True}
    body = json.dumps({"/generate": {"input_ids": [3, 4, 5], "sampling_params": {
                           "max_new_tokens": budget, "n": n, "ignore_eos": True}},
                       "/v1/completions": {"prompt": [3, 4, 5], **common},
                       "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], **common}}[path]
                      ).encode()
    before = figures()["engine/generated_tokens"]
    host, port = front_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + WAIT_S
        while figures()["kv_utilization"] == 0:  # it runs: it holds KV
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.02)
    deadline = time.monotonic() + 10.0
    while figures()["kv_utilization"] > 0:
        assert time.monotonic() < deadline, "the abandoned request still holds its KV blocks"
        time.sleep(0.05)
    assert figures()["engine/generated_tokens"] - before < n * budget  # aborted, not run to the end


def test_serve_http_calls_its_engine_without_a_zmq_hop(http_server):
    """`rollout serve --http`'s own front posts to its engine: the ZMQ server reads no Generate while
    the front generates, and the front's stats, health and weight version are the server's for the
    same engine (the counters are each one's own traffic)."""
    from rollout import RolloutClient
    from rollout.service.metrics import SERVICE_KEYS

    body = {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True}}
    with RolloutClient(http_server.address, timeout=WAIT_S) as client, \
            httpx.Client(base_url=http_server.http_url, timeout=WAIT_S) as web:
        before = client.stats()
        out = web.post("/generate", json=body)
        assert out.status_code == 200 and [len(o["output_ids"]) for o in out.json()] == [3] * 4
        after = client.stats()
        over_http = web.get("/get_server_info").json()["internal_states"][0]
        health = client.health()
        assert web.get("/health").status_code == 200 and health.healthy
        assert web.get("/get_weight_version").json()["weight_version"] == str(health.policy_version)
    for key in ("generates_received", "requests_run", "samples_sent", "tokens_sent"):
        assert after.get(key, 0) == before.get(key, 0), key  # no Generate crossed the socket
    assert after["engine/generated_tokens"] == before["engine/generated_tokens"] + 12
    assert set(SERVICE_KEYS) <= set(over_http) and over_http["requests_run"] >= 2 and over_http["samples_sent"] >= 4
    same = [k for k in after if k.startswith(("engine/", "weight_sync/"))] + \
        ["kv_utilization", "prefix_hit_rate", "queue_depth", "evictions", "policy_version"]
    assert {k: over_http[k] for k in same} == {k: after[k] for k in same}


class HttpWeightControl:
    """A trainer's calls on a replica through SGLang's HTTP weight routes (`weight_sync.WeightControl`),
    with SGLang's fields only: our extensions (a bucket layout, `finish`, a timeout) are not sent."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _post(self, route: str, body: dict) -> dict:
        with httpx.Client(base_url=self.url, timeout=WAIT_S) as web:  # NOTE: called from the sender's threads
            r = web.post(route, json=body)
        if r.status_code != 200 or not r.json()["success"]:
            raise RuntimeError(f"{route}: {r.status_code} {r.text}")
        return r.json()

    def join_group(self, master_address, master_port, rank_offset, world_size, group_name="weight_update_group",
                   backend=None, *, timeout_s=None):
        return self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update(self, source, policy=None) -> int:
        manifest = source.manifest
        assert manifest.layout is None  # SGLang's way: one broadcast per tensor
        self._post("/update_weights_from_distributed", {
            "names": manifest.names, "dtypes": manifest.dtypes, "shapes": manifest.shapes,
            "group_name": source.group_name,
            "weight_version": None if manifest.version is None else f"v{manifest.version}"})
        return self.weight_version()

    def leave_group(self, group_name="weight_update_group"):
        return self._post("/destroy_weights_update_group", {"group_name": group_name})

    def weight_version(self) -> int:
        with httpx.Client(base_url=self.url, timeout=WAIT_S) as web:
            return int(web.get("/get_weight_version").json()["weight_version"])


def test_weights_from_distributed_over_http(web, front_url, model_dir, tmp_path, reference):
    """A gloo trainer drives /init_weights_update_group and /update_weights_from_distributed (one
    broadcast per tensor, as SGLang's callers do): the replica serves the new weights under their
    version, greedy outputs equal a fresh engine's on them."""
    from transformers import LlamaForCausalLM

    from weight_sync import Transport, WeightSender

    new_dir = save_tiny_chat_model(tmp_path / "trained", seed=2)
    trained = LlamaForCausalLM.from_pretrained(new_dir)
    version = int(web.get("/get_weight_version").json()["weight_version"]) + 1
    try:
        with WeightSender([HttpWeightControl(front_url)], Transport.GLOO, timeout_s=WAIT_S,
                          tensor_by_tensor=True) as sender:
            assert sender.sync(trained, version=version) == version
        assert web.get("/get_weight_version").json() == {"weight_version": str(version)}
        fresh = DynamicInferenceEngine.from_pretrained(new_dir, engine_config())
        prompts = [[50, 60, 70], [1, 400, 500, 600]]
        outs = web.post("/generate", json={"input_ids": prompts, "sampling_params": {
            "temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}).json()
        assert [o["output_ids"] for o in outs] == [greedy_ids(fresh, p, 6) for p in prompts]
        assert [o["output_ids"] for o in outs] != [greedy_ids(reference, p, 6) for p in prompts]
        bad = web.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                           "rank_offset": 0, "world_size": 2})
        assert bad.status_code == 400  # rank 0 is the trainer's
    finally:
        restore = web.post("/update_weights_from_disk", json={"model_path": str(model_dir)})
        assert restore.json()["success"] is True


def test_rl_cycle_pause_update_flush_continue(web, model_dir, tmp_path, reference):
    """pause (retract) -> update weights from disk -> flush cache -> continue: the new weight version
    is reported and greedy outputs equal a fresh engine's on the new weights."""
    new_dir = save_tiny_chat_model(tmp_path / "new", seed=1)
    prompts = [[1, 2, 3, 4], [50, 60, 70]]
    before = [web.post("/generate", json={"input_ids": p, "sampling_params": {"temperature": 0,
                                          "max_new_tokens": 6, "ignore_eos": True}}).json() for p in prompts]
    version = int(web.get("/get_weight_version").json()["weight_version"])
    try:
        assert web.post("/pause_generation", json={"mode": "retract"}).status_code == 200
        r = web.post("/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": str(version + 1)})
        assert r.status_code == 200 and r.json()["success"] is True and r.json()["num_paused_requests"] == 0
        assert web.post("/flush_cache", json={}).status_code == 200
        assert web.post("/continue_generation", json={}).json()["status"] == "ok"
        assert web.get("/get_weight_version").json() == {"weight_version": str(version + 1)}
        fresh = DynamicInferenceEngine.from_pretrained(new_dir, engine_config())
        for p, old in zip(prompts, before):
            out = web.post("/generate", json={"input_ids": p, "sampling_params": {"temperature": 0,
                                              "max_new_tokens": 6, "ignore_eos": True}}).json()
            assert out["output_ids"] == greedy_ids(fresh, p, 6) != old["output_ids"]
            assert out["meta_info"]["weight_version"] == str(version + 1)
        bad = web.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
        assert bad.status_code == 400 and bad.json()["success"] is False
    finally:
        web.post("/continue_generation", json={})
        restore = web.post("/update_weights_from_disk", json={"model_path": str(model_dir)})
        assert restore.json()["success"] is True
    out = web.post("/generate", json={"input_ids": prompts[0], "sampling_params": {"temperature": 0,
                                      "max_new_tokens": 6, "ignore_eos": True}}).json()
    assert out["output_ids"] == greedy_ids(reference, prompts[0], 6)


def test_in_process_front_needs_no_server(model_dir, reference):
    """An HTTP front on an engine in this process, no RolloutServer (nor any ZMQ socket) at all."""
    from rollout.client.in_process import InProcessClient
    from rollout.http.launch import serve_front

    engine = DynamicInferenceEngine.from_pretrained(model_dir, engine_config())
    client = InProcessClient(engine, timeout=WAIT_S)
    front = serve_front(client, model_dir, served_model_name=MODEL, max_model_len=MAX_LEN, timeout=WAIT_S,
                        on_stop=client.shutdown)
    try:
        with httpx.Client(base_url=front.url, timeout=WAIT_S) as web:
            out = web.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
                "temperature": 0, "max_new_tokens": 5, "ignore_eos": True}}).json()
            assert out["output_ids"] == greedy_ids(reference, [5, 6, 7], 5)
            assert web.post("/pause_generation", json={"mode": "abort"}).status_code == 200
            assert web.post("/continue_generation", json={}).status_code == 200
            info = web.get("/get_server_info").json()["internal_states"][0]
            assert info["engine/generated_tokens"] == 5 and info["samples_sent"] == 1 and info["pauses"] == 1
    finally:
        front.stop()
    assert not engine.loop_running  # the client started the loop, and stopped it


def test_api_key_and_binding(model_dir):
    from rollout.http.launch import start_front

    with pytest.raises(ValueError, match="API key"):
        start_front("tcp://127.0.0.1:9", model_dir, host="0.0.0.0")  # beyond loopback without a key
    front = start_front("tcp://127.0.0.1:9", model_dir, api_key="s3cret", served_model_name=MODEL)
    try:
        with httpx.Client(base_url=front.url, timeout=WAIT_S) as c:
            refused = c.get("/v1/models")
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"] == MODEL
    finally:
        front.stop()


def test_memory_occupation_by_tag_in_slimes_order(web):
    """slime's colocated cycle: release all, resume the weights (to load new ones), then the KV
    cache; each tag once (the second resume of a part changes nothing); `cuda_graph` goes with the
    KV cache."""
    assert web.post("/release_memory_occupation", json={}).status_code == 200
    assert web.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200  # asleep already
    assert web.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    r = web.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503  # the KV cache still sleeps
    assert web.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert web.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
    assert web.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).is_success
    assert web.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200  # awake: no-op
