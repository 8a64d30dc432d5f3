"""Joining a weight-update group whose peer accepts the connection and never answers (a frozen
trainer, a wrong port), on a real `rollout serve --http --weight-sync-timeout-s 2` process: the
join ends within its timeout with an error that says so (it used to hang without bound, and every
weight update queued behind it hung too); an update sent while it waits is answered, and the
server then updates and generates as before."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import httpx
import pytest

from tests.rollout.http_util import MODEL, http_server_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SYNC_TIMEOUT_S = 2.0
BOUND_S = 20.0  # the join's timeout, its grace and a queued update's turn, with room to spare


@pytest.fixture(scope="module")
def server(model_dir):
    with http_server_process(model_dir, "--weight-sync-timeout-s", str(SYNC_TIMEOUT_S)) as proc:
        yield proc


@pytest.fixture
def silent_peer():
    """A loopback port that accepts connections and never sends a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except (TimeoutError, OSError):
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    listener.close()


def test_a_silent_peer_ends_the_join_within_its_timeout_and_blocks_no_update(server, silent_peer, model_dir):
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": silent_peer, "rank_offset": 1,
                          "world_size": 2}}
    with httpx.Client(base_url=server.http_url, timeout=BOUND_S) as web, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        joining = pool.submit(web.post, "/init_weight_transfer_engine", json=init)
        time.sleep(0.5)  # NOTE: the join is in; this update queues behind it
        update = pool.submit(web.post, "/update_weights_from_disk", json={"model_path": str(model_dir)})
        joined = joining.result(BOUND_S)
        assert joined.status_code >= 400 and "no answer" in joined.text, joined.text
        assert time.monotonic() - start < BOUND_S
        assert update.result(BOUND_S).status_code == 200
        assert time.monotonic() - start < BOUND_S
        reply = web.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3})
        assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 3
