"""Fixtures the HTTP test modules share. By default `model_dir` is the tiny chat model, `http_server`
a `rollout serve --http` process on it, and `front_url` its front twice over: its own (calling the
engine in process) and one in this process over ZMQ to the same server; a module that needs another
model or front defines its own fixture of that name."""

from __future__ import annotations

import openai
import pytest

from rollout.text import TextCodec
from tests.rollout.http_util import MAX_LEN, MODEL, WAIT_S, http_server_process, save_tiny_chat_model


@pytest.fixture(scope="module")
def codec(model_dir):
    return TextCodec.load(model_dir)


@pytest.fixture
def oai(front_url):
    with openai.OpenAI(base_url=f"{front_url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def http_server(model_dir):
    with http_server_process(model_dir) as proc:
        yield proc


@pytest.fixture(scope="module", params=["in_process", "zmq"])
def front_url(request, http_server, model_dir):
    """The HTTP front under test: `rollout serve --http`'s own, or one over ZMQ to the same server."""
    if request.param == "in_process":
        yield http_server.http_url
        return
    from rollout.http.core.clients import FrontClient
    from rollout.http.launch import start_front

    front = start_front(http_server.address, model_dir, served_model_name=MODEL, max_model_len=MAX_LEN,
                        timeout=WAIT_S)
    try:
        assert isinstance(front.front.client, FrontClient)
        yield front.url
    finally:
        front.stop()
