"""Random client mistakes sent to every route of a real `rollout serve --http` process (and random
frames to its ZMQ socket): no answer is a 5xx (over ZMQ: no INTERNAL error), the process never
exits, and a normal generation is served after each batch of them.

A mistake is a random JSON body, a valid body with one field swapped for random JSON, a body
nested tens of thousands deep, or bytes that are not JSON. Routes that change the engine's state
(sleep, pause, weight updates) may accept a body that happens to be valid: the state is put back
after each example, and a 503 is then the engine's honest "not now", not a failure."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.rollout.http_util import MODEL, WAIT_S, http_server_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VALID = {
    "/v1/completions": {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/chat/completions/render": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/inference/v1/generate": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}},
    "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
    "/tokenize": {"model": MODEL, "prompt": "Hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
    "/abort_requests": {"request_ids": ["x"]},
    "/inference/v1/abort_requests": {"request_ids": ["x"]},
    "/abort_request": {"rid": "x"},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/nonexistent"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
    "/load_lora_adapter": {"lora_name": "a", "lora_path": "/nonexistent"},
    "/unload_lora_adapter": {"lora_name": "a"},
    "/update_weight_version": {"new_version": "3"},
    "/update_weights_from_disk": {"model_path": "/nonexistent"},
    "/init_weight_transfer_engine": {"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                                   "rank_offset": 1, "world_size": 2}},
    "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                   "world_size": 2, "group_name": "g"},
    "/update_weights": {"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}},
    "/update_weights_from_distributed": {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
    "/update_weights_from_tensor": {"serialized_named_tensors": ["x"]},
    "/destroy_weights_update_group": {"group_name": "g"},
    "/finish_weight_update": {"weight_version": "3"},
    "/start_weight_update": {},
    "/finish_session": {},
    "/collective_rpc": {"method": "x"},
    "/pause": {}, "/resume": {}, "/sleep": {}, "/wake_up": {}, "/reset_prefix_cache": {},
    "/pause_generation": {}, "/continue_generation": {}, "/flush_cache": {},
    "/release_memory_occupation": {}, "/resume_memory_occupation": {},
}
ROUTES = sorted(VALID)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@st.composite
def mistakes(draw) -> tuple[str, bytes]:
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["random", "field", "deep", "bytes"]))
    if kind == "random":
        return route, json.dumps(draw(json_values)).encode()
    if kind == "deep":
        depth = draw(st.sampled_from([1_000, 50_000]))
        return route, ("[" * depth + "]" * depth).encode() if draw(st.booleans()) else \
            ('{"a":' * depth + "1" + "}" * depth).encode()
    if kind == "bytes":
        return route, draw(st.binary(max_size=64))
    body = json.loads(json.dumps(VALID[route]))  # a copy to change
    where = draw(st.sampled_from(_paths(body) or [("x",)]))
    node = body
    for step in where[:-1]:
        node = node[step]
    node[where[-1]] = draw(json_values)
    return route, json.dumps(body).encode()


def _paths(node, prefix: tuple = ()) -> list[tuple]:
    """Every place in a body a value sits (keys of objects, indices of arrays), at any depth."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out = []
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    with http_server_process(model_dir, "--weight-sync-timeout-s", "1") as proc:
        yield proc


def _restore(web: httpx.Client, model_dir) -> None:
    web.post("/wake_up")
    web.post("/resume")
    if web.get("/health").content:  # weights discarded by a level-2 sleep: load them again
        assert web.post("/update_weights_from_disk", json={"model_path": str(model_dir)}).status_code == 200


def _serves(web: httpx.Client) -> None:
    reply = web.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert reply.status_code == 200, reply.text


@settings(max_examples=160, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(mistake=mistakes())
def test_no_client_mistake_gets_a_5xx_or_stops_the_server(server, model_dir, mistake):
    route, body = mistake
    with httpx.Client(base_url=server.http_url, timeout=WAIT_S) as web:
        reply = web.post(route, content=body, headers={"content-type": "application/json"})
        asleep_or_paused = route in {"/sleep", "/pause", "/pause_generation", "/release_memory_occupation",
                                     "/start_weight_update"}
        allowed = {503} if asleep_or_paused else set()
        assert reply.status_code < 500 or reply.status_code in allowed, (route, body[:200], reply.text[:300])
        assert server.proc.poll() is None
        _restore(web, model_dir)
        _serves(web)
