"""Requests that used to hold the server's resources or time, on a real `rollout serve --http`
process: a non-streaming `/inference/v1/generate` whose client left keeps nothing (its requests
are aborted at once, as `/v1/completions` does); `bad_words` past the bound every other route
holds is refused before anything is tokenized, and the server serves on."""

from __future__ import annotations

import time

import httpx
import pytest

from inference import SamplingParams
from inference.sampling.params import MAX_BAD_WORDS
from tests.rollout.http_util import MODEL, WAIT_S

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gauge(web: httpx.Client, name: str) -> float:
    line = next(ln for ln in web.get("/metrics").text.splitlines() if ln.startswith(name))
    return float(line.split()[-1])


def _until(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("route", ["/inference/v1/generate", "/v1/completions"])
def test_a_client_that_leaves_a_non_streaming_generation_frees_its_requests(http_server, route):
    body = ({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 64, "n": 4}} if route.startswith("/inference")
            else {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 64, "n": 4})
    with httpx.Client(base_url=http_server.http_url, timeout=WAIT_S) as web:
        assert web.post("/pause", params={"mode": "keep"}).status_code == 200  # NOTE: it waits, never finishes
        try:
            with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=http_server.http_url, timeout=1.0) as gone:
                gone.post(route, json=body)  # the client gives up and closes its connection
            assert _until(lambda: _gauge(web, "vllm:num_requests_waiting") == 0)
        finally:
            assert web.post("/resume").status_code == 200


def test_bad_words_past_the_bound_are_refused_on_every_route(http_server):
    words = [f"w{i}" for i in range(100_000)]
    with httpx.Client(base_url=http_server.http_url, timeout=WAIT_S) as web:
        start = time.monotonic()
        refused = web.post("/inference/v1/generate", json={"token_ids": [1, 2, 3],
                                                           "sampling_params": {"max_tokens": 2, "bad_words": words}})
        assert refused.status_code == 400 and "bad_words" in refused.text, refused.text[:300]
        refused = web.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2,
                                                    "bad_words": words})
        assert refused.status_code == 400 and "bad_words" in refused.text
        assert time.monotonic() - start < 5.0  # refused before any word is tokenized
        served = web.post("/inference/v1/generate", json={"token_ids": [1, 2, 3], "sampling_params": {
            "max_tokens": 2, "bad_words": ["hello", "world"]}})
        assert served.status_code == 200
    with pytest.raises(ValueError, match=f"at most {MAX_BAD_WORDS}"):  # in process and over ZMQ alike
        SamplingParams(bad_words_token_ids=[[5]] * (MAX_BAD_WORDS + 1))
