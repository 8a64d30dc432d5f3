"""What HTTP clients may hold of the front, and what a request must show (`rollout.http.core.connections`,
`rollout.http.core.guards`), on a real uvicorn front on loopback driven by httpx and raw sockets.

The front here is connected to no service (nothing listens at its address): every check under
test answers before a route calls the engine, and a request that passed them gets the route's
own refusal (a wrong model's 404), which shows it passed.
"""

from __future__ import annotations

import select
import socket
import time

import httpx
import pytest

from rollout.http.core.connections import ConnectionLimits
from rollout.http.core.errors import from_exception
from tests.rollout.http_util import MODEL, smollm2_tokenizer_dir

NO_SERVICE = "tcp://127.0.0.1:9"
WAIT_S = 10.0


def start(**kwargs):
    from rollout.http.launch import start_front

    return start_front(NO_SERVICE, smollm2_tokenizer_dir(), served_model_name=MODEL, timeout=5.0, **kwargs)


@pytest.fixture(scope="module")
def front():
    """Small limits, so the tests can reach them: 4 connections, 2 s for a head, 4 KiB of body."""
    running = start(limits=ConnectionLimits(header_timeout_s=2.0, body_timeout_s=2.0, max_body_bytes=4096,
                                            max_connections=4), allowed_hosts=["rollout.internal"])
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def web(front):
    with httpx.Client(base_url=front.url, timeout=WAIT_S) as c:
        yield c


def connect(front) -> socket.socket:
    sock = socket.create_connection((front.server.host, front.server.port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes (still open past `deadline`: the test fails)."""
    got = b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:  # closed with our unread bytes in its buffer
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the server kept the connection open; it sent {got!r}")


def trickle_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Send a header byte every 0.2 s (never a whole head) until the server closes; what it sent."""
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            return b""
        if select.select([sock], [], [], 0.2)[0]:
            return read_until_closed(sock, deadline)
    raise AssertionError("the server kept a trickling client's connection open")


def test_trickled_heads_are_dropped_and_connections_bounded(front, web):
    held = [connect(front) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # a head never finished
        time.sleep(0.3)  # NOTE: the server accepts them first (well within the 2 s head timeout)
        extra = connect(front)  # the fifth: refused at once, its descriptor freed
        assert read_until_closed(extra, time.monotonic() + WAIT_S).startswith(b"HTTP/1.1 503")
        extra.close()
        started = time.monotonic()
        trickle_until_closed(held[0], started + WAIT_S)  # the head timeout counts from the first byte
        for sock in held[1:]:
            assert read_until_closed(sock, started + WAIT_S).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - started < WAIT_S
    finally:
        for sock in held:
            sock.close()
    assert web.get("/v1/models").status_code == 200  # still serving, its connections free again


def test_past_the_connection_limit_every_refusal_is_a_readable_503(front, web):
    """A refused client that sent its whole request at once still reads the 503: the server drops
    its unread bytes instead of closing on them (which the kernel answers with a reset)."""
    held = [connect(front) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        time.sleep(0.3)
        answers = []
        for _ in range(20):
            extra = connect(front)
            body = b'{"model": "x", "prompt": "' + b"y" * 3000 + b'"}'
            extra.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            time.sleep(0.05)  # NOTE: the body arrives after the refusal was written, as a slow client's does
            try:
                extra.sendall(body)
                answers.append(read_until_closed(extra, time.monotonic() + WAIT_S)[:12])
            except ConnectionResetError:
                answers.append(b"reset")
            extra.close()
        assert answers == [b"HTTP/1.1 503"] * 20
    finally:
        for sock in held:
            sock.close()
    time.sleep(2.5)  # NOTE: the held heads time out and the lingering refusals close
    assert web.get("/v1/models").status_code == 200


def test_a_body_or_head_that_never_ends_is_dropped(front):
    with connect(front) as sock:  # a body that stops short of its Content-Length
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"text\": ")
        started = time.monotonic()
        read_until_closed(sock, started + WAIT_S)  # closed by the 2 s body timeout (the route sees it gone)
        assert time.monotonic() - started < WAIT_S
    with connect(front) as sock:  # a head past max_header_bytes (64 KiB), still growing
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"a" * 70_000)
        assert read_until_closed(sock, time.monotonic() + WAIT_S).startswith(b"HTTP/1.1 431")


def test_a_host_must_name_this_server(front, web):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own name as `Host`."""
    refused = web.get("/v1/models", headers={"Host": f"attacker.example:{front.server.port}"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_host"
    assert "--allowed-host attacker.example" in refused.json()["error"]["message"]
    assert web.post("/pause_generation", json={"mode": "abort"}, headers={"Host": "attacker.example"}
                    ).status_code == 400
    for host in (f"127.0.0.1:{front.server.port}", "localhost", f"[::1]:{front.server.port}", "rollout.internal:80"):
        assert web.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_with_an_api_key_any_host_name_may_reach_the_front():
    """A page cannot send the key, so a keyed front (the only kind beyond loopback) takes a cluster's
    service names without `--allowed-host`."""
    keyed = start(api_key="k-1")
    try:
        with httpx.Client(base_url=keyed.url, timeout=WAIT_S) as c:
            host = {"Host": "rollout-0.rollout.svc.cluster.local:8000"}
            assert c.get("/v1/models", headers={**host, "Authorization": "Bearer k-1"}).status_code == 200
            assert c.get("/v1/models", headers=host).status_code == 401
    finally:
        keyed.stop()


def test_calls_that_change_state_need_a_json_content_type(web):
    """What a cross-site page can send without a preflight (text/plain, a form, a body-less fetch
    or an `<img>`, which carry a browser's Origin / Sec-Fetch-Site) is refused."""
    for method, path, kwargs in [("POST", "/update_weights_from_disk",
                                  {"content": b'{"model_path": "/tmp"}', "headers": {"Content-Type": "text/plain"}}),
                                 ("POST", "/init_weights_update_group",
                                  {"data": {"master_address": "10.0.0.1", "master_port": "29500"}})]:
        r = web.request(method, path, **kwargs)
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"], path
    for method, path, headers in [("POST", "/pause_generation", {"Origin": "https://attacker.example"}),
                                  ("POST", "/pause_generation", {"Origin": "null"}),
                                  ("GET", "/release_memory_occupation", {"Sec-Fetch-Site": "cross-site"}),
                                  ("GET", "/flush_cache", {"Sec-Fetch-Site": "same-site"})]:
        r = web.request(method, path, headers=headers)
        assert r.status_code == 403 and "another site" in r.json()["error"]["message"], (path, headers)
    r = web.post("/v1/completions", content=b'{"model": "x", "prompt": "hi"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"  # OpenAI's shape
    assert web.post("/v1/completions", json={"model": "x", "prompt": "hi"}).status_code == 404  # JSON: it passes
    assert web.post("/v1/completions", json={"model": "x", "prompt": "hi"},
                    headers={"Origin": "http://127.0.0.1:8000"}).status_code == 404  # this server's own origin
    assert web.get("/v1/models").status_code == 200  # reads need nothing
    # SGLang's own tools POST with no body and no browser marks: past the guard (here to a body check, a 400)
    assert web.post("/v1/completions").status_code == 400
    assert web.post("/v1/completions", headers={"Sec-Fetch-Site": "same-origin"}).status_code == 400


def test_a_body_past_the_limit_is_refused_with_413(web):
    big = {"model": "x", "prompt": "a" * 5000}
    r = web.post("/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r.headers["connection"] == "close"

    def chunks():  # no Content-Length: the bound holds as the body grows
        yield b'{"model": "x", "prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    r = web.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "exceeds 4096 bytes" in r.json()["error"]["message"]
    assert web.post("/v1/completions", json={"model": "x", "prompt": "a" * 3000}).status_code == 404  # under it


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "ab\\ud800"}', "prompt"),
    ("/v1/completions", b'{"model": "\\udfff", "prompt": "x"}', "model"),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": ["ok", "\\ud83d"]}', "prompt.1"),
    ("/v1/chat/completions", b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], '
     b'"tools": [{"type": "function", "function": {"name": "\\udc00"}}]}', "tools.0.function.name"),
    ("/generate", b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text"),
    ("/generate", b'{"text": "x", "sampling_params": {"stop": ["\\udbff"]}}', "sampling_params.stop.0"),
])
def test_lone_surrogates_are_a_400_naming_the_field(web, path, body, param):
    r = web.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["message"]
    assert f"'{param}'" in message and "surrogate" in message
    if path.startswith("/v1"):
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("body, message, param", [
    (b'{"model": "tiny-chat", "prompt": ', "We could not parse the JSON body", None),
    (b'', "We could not parse the JSON body", None),
    (b'{"model": "tiny-chat"}', "Missing required parameter: 'prompt'.", "prompt"),
    (b'{"model": "tiny-chat", "prompt": "x", "frobnicate": 1}', "Unrecognized request argument supplied: frobnicate",
     "frobnicate"),
    (b'{"model": "tiny-chat", "prompt": "x", "max_tokens": "many"}', "Invalid value for 'max_tokens'", "max_tokens"),
    (b'{"model": "tiny-chat", "prompt": "x", "n": 2, "best_of": 1}',
     "best_of must be greater than or equal to n, got n=2", "best_of"),
])
def test_a_refused_body_is_worded_as_openai_words_it(web, body, message, param):
    """Each kind of validation error (pydantic's, read once into `ValidationKind`, and the schemas' own)
    gets OpenAI's wording and names the field it is about."""
    r = web.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["param"] == param


def test_validation_kinds_read_pydantic_s_strings_once():
    from rollout.http.core.schemas import ValidationKind

    assert ValidationKind.of("missing") is ValidationKind.MISSING
    assert ValidationKind.of("field_error") is ValidationKind.FIELD_ERROR
    assert ValidationKind.of("int_parsing") is ValidationKind.OTHER and ValidationKind.of(None) is ValidationKind.OTHER


def test_engine_refusals_for_now_say_when_to_retry():
    """OVERLOADED (the engine's waiting queue full) is 429, a state that refuses work for now 503,
    both with Retry-After; in process (the engine's exceptions) or over ZMQ (its ErrorCodes)."""
    from inference.errors import OverloadedError, TensorStateDeallocatedError
    from rollout.wire.codec import ProtocolError
    from rollout.wire.kinds import ErrorCode

    for exc, status, retry in [(OverloadedError("queue full", retry_after_s=2.5), 429, "3"),
                               (ProtocolError(ErrorCode.OVERLOADED, "queue full"), 429, "1"),
                               (ProtocolError(ErrorCode.ENGINE_STATE, "suspended"), 503, "1"),
                               (TensorStateDeallocatedError(None, "suspended"), 503, "1")]:
        err = from_exception(exc)
        assert (err.status, err.headers) == (status, {"Retry-After": retry}), exc


def test_an_empty_call_of_another_media_type_passes_a_form_does_not(web):
    """aiohttp (SkyRL's client) posts `/pause?mode=keep` with no body as application/octet-stream:
    no page can send that cross-site without a preflight, so it passes the guard (here to a body
    check, a 400); an empty form or text post is refused."""
    octet = {"Content-Type": "application/octet-stream"}
    assert web.post("/v1/completions", headers=octet).status_code == 400
    for media in ("application/x-www-form-urlencoded", "text/plain;charset=UTF-8", "multipart/form-data; boundary=x"):
        r = web.post("/v1/completions", headers={"Content-Type": media})
        assert r.status_code == 415, media
