"""The audit's storm as one `stress` run (issue 24): a server with its own HTTP front, a router over
it with a front of its own, and at once

* 10,000 fuzzed ZMQ frames (`tests/rollout/server/test_service_fuzz.py`'s kinds), half at the
  server and half at the router, each answered exactly once with what the decoder predicts;
* 1,000 HTTP cases of the audit's kinds (lone surrogates, text/plain and foreign-Host POSTs to
  state-changing routes, oversized and broken bodies, absurd n, weight loads from a FIFO, a
  symlink out of the directory and /etc, clients that hang up mid-request), half at each front:
  never a 5xx, never a refused attack served;
* well-behaved clients whose greedy outputs are checked against an in-process engine;

then one client's 32,768 samples while another client's small requests run: their p99 stays
under 2 s. Throughout, no process dies and every wait is bounded; afterwards the server's and the
router's RSS are within 10% of what they were after warm-up, and both still serve correctly.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq

from rollout import RolloutClient
from rollout.wire.codec import DEFAULT_MAX_FRAME_BYTES
from tests.rollout.http_util import MAX_LEN, MODEL, save_tiny_chat_model
from tests.rollout.server.test_service_fuzz import send_frames
from tests.rollout.service_util import FRAME_LIMIT, WAIT_S, greedy, random_prompts

pytestmark = pytest.mark.stress

ZMQ_FRAMES = 10_000
HTTP_CASES = 1_000
WARM_FRAMES, WARM_CASES = 500, 50  # per target, before the RSS baseline
BIG_PROMPTS, BIG_N = 256, 128  # 32,768 samples from one client (n <= max_requests)
SERVER_ARGS = ("--threads", "1", "--block-size", "4", "--num-blocks", "4096", "--max-requests", "128",
               "--max-batch-tokens", "1024", "--max-seq-len", str(MAX_LEN), "--max-frame-bytes", str(FRAME_LIMIT),
               "--http", "0", "--served-model-name", MODEL)


def engine_busy(stats: dict) -> int:
    """Requests the served engine holds (HTTP requests of `serve --http` reach it in process, so the
    server's own registry does not count them)."""
    return sum(int(stats.get(f"engine/{k}", 0)) for k in ("waiting", "active_request_count", "paused_request_count"))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from inference import DynamicInferenceEngine, InferenceConfig
    from rollout import ServerProcess
    from rollout.http.launch import start_front
    from rollout.router.process import RouterProcess

    model = save_tiny_chat_model(tmp_path_factory.mktemp("storm-model"))
    traps = tmp_path_factory.mktemp("storm-traps")
    (traps / "fifo").mkdir()
    os.mkfifo(traps / "fifo" / "model.safetensors")
    (traps / "escape").mkdir()
    (traps / "escape" / "model.safetensors").symlink_to("/etc/passwd")
    server = ServerProcess(model, *SERVER_ARGS, ready_timeout=WAIT_S)
    try:
        router = RouterProcess("--replicas", server.address, ready_timeout=WAIT_S)
        try:
            front = start_front(router.address, model, served_model_name=MODEL, max_model_len=MAX_LEN, timeout=WAIT_S)
            try:
                config = InferenceConfig(block_size=4, num_blocks=4096, max_requests=128, max_batch_tokens=1024,
                                         max_sequence_length=MAX_LEN)
                reference = DynamicInferenceEngine.from_pretrained(model, config)
                yield {"server": server, "router": router, "front": front, "reference": reference, "traps": traps}
            finally:
                front.stop()
        finally:
            router.stop(grace_s=10.0)
    finally:
        server.stop(grace_s=10.0)


# ---- ZMQ ---------------------------------------------------------------------------------------


def fuzz_zmq(address: str, max_frame_bytes: int, seed: int, count: int, outcomes: Counter) -> None:
    """`count` frames, one at a time, each answered exactly once as predicted."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(address)
        send_frames(sock, rng, count, outcomes, max_frame_bytes=max_frame_bytes, first_id=seed * 1_000_000)
    finally:
        sock.close()
        ctx.term()


# ---- HTTP --------------------------------------------------------------------------------------

NOT_SERVED = range(400, 500)  # a refusal by rule: never served, never a 5xx


def http_case(rng: random.Random, traps: Path) -> tuple[str, str, dict, bytes, object]:
    """(method, path, headers, body, what the answer's status must be in)."""
    js = {"Content-Type": "application/json"}
    kind = rng.choice(["completion"] * 4 + ["generate"] * 2 + ["surrogate", "text-plain", "host", "big", "broken",
                                                                 "huge-n", "weights-trap", "unknown", "method",
                                                                 "hang-up", "stream"])
    if kind == "completion":
        body = {"model": MODEL, "prompt": "The sky is", "max_tokens": rng.randint(1, 4), "temperature": 0}
        return "POST", "/v1/completions", js, json.dumps(body).encode(), (200,)
    if kind == "generate":
        body = {"text": "hello there", "sampling_params": {"max_new_tokens": rng.randint(1, 4)}}
        return "POST", "/generate", js, json.dumps(body).encode(), (200,)
    if kind == "surrogate":  # NOTE: json.dumps writes a lone surrogate as the escape \ud800, as a browser would
        where = rng.choice(["prompt", "chat", "generate", "model"])
        bad = "a\ud800b"
        body, path = {
            "prompt": ({"model": MODEL, "prompt": bad, "max_tokens": 2}, "/v1/completions"),
            "chat": ({"model": MODEL, "messages": [{"role": "user", "content": bad}], "max_tokens": 2},
                     "/v1/chat/completions"),
            "generate": ({"text": bad, "sampling_params": {"max_new_tokens": 2}}, "/generate"),
            "model": ({"model": bad, "prompt": "hi", "max_tokens": 2}, "/v1/completions"),
        }[where]
        return "POST", path, js, json.dumps(body).encode(), NOT_SERVED
    if kind == "text-plain":  # a cross-site form post: must not pause, suspend or load anything
        path = rng.choice(["/pause_generation", "/release_memory_occupation", "/update_weights_from_disk",
                           "/init_weights_update_group", "/flush_cache"])
        return "POST", path, {"Content-Type": "text/plain"}, b'{"model_path": "/tmp"}', NOT_SERVED
    if kind == "host":  # DNS rebinding: a page's own name pointed at loopback
        path = rng.choice(["/pause_generation", "/v1/completions", "/release_memory_occupation"])
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        return "POST", path, {**js, "Host": "attacker.example"}, json.dumps(body).encode(), NOT_SERVED
    if kind == "big":
        return "POST", "/v1/completions", js, json.dumps({"model": MODEL, "prompt": "a " * 2_000_000}).encode(), \
            NOT_SERVED
    if kind == "broken":
        return "POST", rng.choice(["/v1/completions", "/generate", "/v1/chat/completions"]), js, \
            rng.choice([b"{", b"[]", b"null", b'{"prompt": 5}', rng.randbytes(64)]), NOT_SERVED
    if kind == "huge-n":
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": rng.choice([10**5, 10**9, -1])}
        return "POST", "/v1/completions", js, json.dumps(body).encode(), NOT_SERVED
    if kind == "weights-trap":
        path = rng.choice([traps / "fifo", traps / "escape", Path("/etc"), traps / "missing"])
        return "POST", "/update_weights_from_disk", js, json.dumps({"model_path": str(path)}).encode(), NOT_SERVED
    if kind == "unknown":
        return "POST", "/v1/nothing-here", js, b"{}", (404,)
    if kind == "method":
        return "GET", "/v1/completions", {}, b"", (405,)
    if kind == "hang-up":
        body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 200, "temperature": 1.0,
                "ignore_eos": True}
        return "POST", "/v1/completions", js, json.dumps(body).encode(), None
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 3, "stream": True}
    return "POST", "/v1/completions", js, json.dumps(body).encode(), (200,)


def fuzz_http(url: str, traps: Path, seed: int, count: int, outcomes: Counter) -> None:
    host, port = url.removeprefix("http://").split(":")
    rng = random.Random(seed)
    for _ in range(count):
        method, path, headers, body, allowed = http_case(rng, traps)
        if allowed is None:  # a client that hangs up before the answer: the engine must drop its work
            with socket.create_connection((host, int(port)), timeout=WAIT_S) as raw:
                raw.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            outcomes["hang-up"] += 1
            continue
        conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        try:
            conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
            for name, value in headers.items():
                conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            reply = conn.getresponse()
            data = reply.read()
        finally:
            conn.close()
        assert reply.status in allowed, (method, path, headers, body[:200], reply.status, data[:300])
        outcomes[f"{reply.status}"] += 1


# ---- the storm ---------------------------------------------------------------------------------


def test_storm_against_server_and_router(stack, one_torch_thread):
    server, router, front, traps = stack["server"], stack["router"], stack["front"], stack["traps"]
    targets = [("zmq", server.address, FRAME_LIMIT), ("zmq", router.address, DEFAULT_MAX_FRAME_BYTES),
               ("http", server.http_url, None), ("http", front.url, None)]
    prompts = random_prompts(6, 2, 8, seed=5)
    want = [[o.generated_token_ids for o in s.result(WAIT_S)]
            for s in stack["reference"].submit_many(prompts, [greedy(6)] * len(prompts))]
    outcomes = {i: Counter() for i in range(len(targets))}

    def run(i: int, count: int, seed: int) -> None:
        kind, address, limit = targets[i]
        if kind == "zmq":
            fuzz_zmq(address, limit, seed, count, outcomes[i])
        else:
            fuzz_http(address, traps, seed, count, outcomes[i])

    for i, (kind, _, _) in enumerate(targets):  # warm-up: first connections, first of each kind of reply
        run(i, WARM_FRAMES if kind == "zmq" else WARM_CASES, seed=100 + i)
    baseline = {p.pid: rss_bytes(p.pid) for p in (server, router)}

    stop, failures, checked = threading.Event(), [], Counter()

    def guarded(fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 (reported on the test's thread)
            failures.append(exc)

    def well_behaved(address: str) -> None:
        with RolloutClient(address, timeout=WAIT_S) as client:
            while not stop.is_set():
                batch = client.generate(prompts, 1, greedy(6))
                assert [[r.completion_ids] for r in batch] == want
                checked[address] += 1

    counts = [ZMQ_FRAMES // 2 - WARM_FRAMES] * 2 + [HTTP_CASES // 2 - WARM_CASES] * 2
    storm = [threading.Thread(target=guarded, args=(run, i, counts[i], 200 + i)) for i in range(len(targets))]
    bystanders = [threading.Thread(target=guarded, args=(well_behaved, a)) for a in (server.address, router.address)]
    for t in storm + bystanders:
        t.start()
    for t in storm:
        t.join(15 * 60)
    stop.set()
    for t in bystanders:
        t.join(2 * WAIT_S)
    assert not any(t.is_alive() for t in storm + bystanders), "a storm thread hung"
    assert not failures, failures[0]
    print(f"\nstorm outcomes: {[dict(sorted(c.items())) for c in outcomes.values()]}, bystanders {dict(checked)}")
    assert server.alive() and router.alive()
    assert all(checked[a] >= 1 for a in (server.address, router.address))
    for i in (0, 1):
        assert "error:INTERNAL" not in outcomes[i]
        assert sum(v for k, v in outcomes[i].items() if k != "skipped") == ZMQ_FRAMES // 2
    for i in (2, 3):
        assert sum(outcomes[i].values()) == HTTP_CASES // 2 and not any(k.startswith("5") for k in outcomes[i])

    with RolloutClient(server.address, timeout=WAIT_S) as client:  # the hung-up requests were dropped
        deadline = time.monotonic() + WAIT_S
        while engine_busy(client.stats()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine_busy(client.stats()) == 0
        assert [[r.completion_ids] for r in client.generate(prompts, 1, greedy(6))] == want
    for proc in (server, router):
        grown = rss_bytes(proc.pid) / baseline[proc.pid]
        print(f"RSS of {proc.pid}: {baseline[proc.pid] / 2**20:.0f} MiB after warm-up, x{grown:.3f} after the storm")
        assert grown <= 1.10


@pytest.mark.parametrize("path", ["server", "router"])
def test_small_requests_keep_moving_during_a_32768_sample_request(stack, path, one_torch_thread):
    server, address = stack["server"], stack[path].address
    big_prompts = random_prompts(BIG_PROMPTS, 4, 8, seed=9)
    small = random_prompts(40, 2, 2, seed=10)
    from inference import SamplingParams

    with RolloutClient(address, timeout=10 * WAIT_S) as big, RolloutClient(address, timeout=WAIT_S) as c, \
            RolloutClient(server.address, timeout=WAIT_S) as direct:
        handle = big.stream(big_prompts, BIG_N, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
        deadline = time.monotonic() + WAIT_S  # the big request is running before the small ones arrive
        while engine_busy(direct.stats()) < BIG_N and time.monotonic() < deadline:
            time.sleep(0.05)
        latencies = []
        for prompt in small:
            start = time.perf_counter()
            (rollout,) = c.generate([prompt], 1, greedy(2))
            latencies.append(time.perf_counter() - start)
            assert len(rollout.completion_ids) == 2
        still_busy = engine_busy(direct.stats())
        batch = handle.result(10 * WAIT_S)
    seen = Counter((r.group, r.sample_index) for r in batch)
    assert len(seen) == BIG_PROMPTS * BIG_N and set(seen.values()) == {1}  # every sample, once
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(f"\n{path}: small requests during {BIG_PROMPTS * BIG_N} samples: p50 {latencies[len(latencies) // 2]:.3f} s, "
          f"p99 {p99:.3f} s")
    assert p99 < 2.0
    assert still_busy > 0, "the big request was over before the small ones were done: not a test of fairness"
