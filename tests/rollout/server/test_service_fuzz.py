"""At least 10,000 random and mutated frames at a live server (the shared `rollout serve` process).

Each frame goes out on a raw DEALER socket, one at a time, and its whole answer is awaited: a
frame the protocol refuses gets exactly one `ErrorReply` with the code (and request id) the local
decoder gives; a valid request its usual answer. Valid requests that would change the server's
state (pause, suspend, weight update) or run long (more than a few tokens) are not sent: the
point is the parser, not the engine. Meanwhile a well-behaved client's requests run, and after
the storm the server is alive and serves a valid request with the right output.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import msgspec
import numpy as np
import pytest
import torch
import zmq

from inference import SamplingParams
from rollout import RolloutClient
from rollout.wire.codec import ProtocolError, decode_reply, decode_request, encode
from rollout.wire.messages import (
    Abort,
    ErrorReply,
    Generate,
    Health,
    Heartbeat,
    Pause,
    ResetPrefixCache,
    Result,
    SampleOutput,
    Stats,
    Suspend,
    TokenDelta,
    UpdateWeights,
)
from tests.rollout.service_util import FRAME_LIMIT, VOCAB, WAIT_S, expected_outputs, greedy, random_prompts

N_FRAMES = 10_000
MAX_TOKENS_SENT = 8  # n * max_tokens of a valid Generate the fuzzer sends (others are skipped)
REPLY_WAIT_MS = 20_000


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def base_message(rng: random.Random, i: int):
    """A valid request to mutate; ids are unique per frame so answers can be told apart."""
    kind = rng.choice(["generate"] * 5 + ["abort", "health", "stats", "heartbeat", "reset"])
    if kind == "generate":
        sampling = SamplingParams(n=rng.randint(1, 2), temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 3),
                            ignore_eos=True, logprobs=rng.choice([None, 2]), seed=rng.choice([None, 7]))
        prompt = np.array([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))], dtype="<i4")
        return Generate(request_id=f"fz{i:06d}", prompt_token_ids=prompt, sampling=sampling,
                        stream_tokens=rng.random() < 0.2)
    if kind == "abort":
        return Abort(request_id=f"fa{i:06d}", targets=[f"fz{max(0, i - 1):06d}"])
    if kind == "heartbeat":
        return Heartbeat(request_id=f"fh{i:06d}", lease_s=30.0)
    cls = {"health": Health, "stats": Stats, "reset": ResetPrefixCache}[kind]
    return cls(request_id=f"fc{i:06d}")


RANDOM_VALUES = [None, True, -1, 0, 1, 2**31, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 300,
                 b"\x00\x01\x02", b"\xff" * 7, [], [1, -2], {}, {"a": 1}, {1: 2}, 384, 1e308]


def mutate(rng: random.Random, data: bytearray) -> bytes:
    for _ in range(rng.randint(1, 4)):
        pos, blob = rng.randrange(len(data) + 1), rng.randbytes(rng.randint(1, 4))
        op = rng.choice("fidt")
        if op == "f" and pos < len(data):
            data[pos] ^= blob[0] or 0xFF
        elif op == "i":
            data[pos:pos] = blob
        elif op == "d":
            del data[pos: pos + len(blob)]
        elif op == "t":
            del data[pos:]
    return bytes(data)


def make_frame(rng: random.Random, i: int) -> list[bytes]:
    """One message (a list of frames: multipart ones are bad too)."""
    roll = rng.random()
    if roll < 0.25:
        return [rng.randbytes(rng.randint(0, 300))]
    base = encode(base_message(rng, i))
    if roll < 0.75:
        return [mutate(rng, bytearray(base))]
    if roll < 0.95:
        fields = msgspec.msgpack.decode(base)
        key = rng.choice(list(fields) + ["sampling", "prompt_token_ids", "kind", "v", "extra", "targets", "lease_s"])
        if rng.random() < 0.5 and isinstance(fields.get("sampling"), dict):
            fields["sampling"][rng.choice(list(fields["sampling"]) + ["bogus"])] = rng.choice(RANDOM_VALUES)
        else:
            fields[key] = rng.choice(RANDOM_VALUES)
        return [msgspec.msgpack.encode(fields)]
    special = rng.choice(["multipart", "empty", "oversized", "oversized-valid"])
    if special == "multipart":
        return [base, base]
    if special == "empty":
        return [b""]
    if special == "oversized":
        return [rng.randbytes(FRAME_LIMIT + rng.randint(1, 4096))]
    big = Generate(request_id=f"fz{i:06d}", prompt_token_ids=np.ones(FRAME_LIMIT // 4 + 10, "<i4"))
    return [encode(big, max_frame_bytes=2 * FRAME_LIMIT)]


def expectation(frames: list[bytes], max_frame_bytes: int = FRAME_LIMIT):
    """What a service with `max_frame_bytes` must answer: ("error", code, request_id), ("generate", msg),
    ("result", msg), or None to skip (a valid request that would change its state or run long)."""
    if len(frames) != 1:
        return ("error", "MALFORMED", None)
    try:
        msg = decode_request(frames[0], max_frame_bytes=max_frame_bytes)
    except ProtocolError as err:
        return ("error", err.code.name, err.request_id)
    if isinstance(msg, (Pause, Suspend, UpdateWeights)):
        return None
    if isinstance(msg, Generate):
        return ("generate", msg) if msg.sampling.n * msg.sampling.max_tokens <= MAX_TOKENS_SENT else None
    return ("result", msg)


def answer(sock: zmq.Socket, expected) -> str:
    """Receive the whole answer to one frame; returns what it was ("error:CODE", "samples", "result")."""
    samples: set[int] = set()
    while True:
        assert sock.poll(REPLY_WAIT_MS), f"no answer within {REPLY_WAIT_MS} ms to {expected}"
        reply = decode_reply(sock.recv())
        if expected[0] == "error":
            assert isinstance(reply, ErrorReply), (expected, reply)
            assert (reply.code.name, reply.request_id) == expected[1:], (expected, reply)
            assert reply.message
            return f"error:{reply.code.name}"
        msg = expected[1]
        assert reply.request_id == msg.request_id, (msg, reply)
        if isinstance(reply, ErrorReply):
            assert reply.code.name != "INTERNAL", reply
            return f"error:{reply.code.name}"
        if expected[0] == "result":
            assert isinstance(reply, Result), reply
            return "result"
        if isinstance(reply, TokenDelta):
            continue
        assert isinstance(reply, SampleOutput), reply
        samples.add(reply.sample_index)
        if len(samples) == msg.sampling.n:
            return "samples"


def send_frames(sock: zmq.Socket, rng: random.Random, count: int, outcomes: Counter, *,
                max_frame_bytes: int = FRAME_LIMIT, first_id: int = 0) -> None:
    """`count` frames on the connected `sock`, one at a time, each answer checked against what a
    service with `max_frame_bytes` must say; `outcomes` counts them (and the frames skipped)."""
    sent = i = 0
    while sent < count:
        frames = make_frame(rng, first_id + i)
        i += 1
        expected = expectation(frames, max_frame_bytes)
        if expected is None:
            outcomes["skipped"] += 1
            continue
        sock.send_multipart(frames)
        sent += 1
        outcomes[answer(sock, expected)] += 1
    assert not sock.poll(200), "an answer nobody asked for"


def test_ten_thousand_bad_frames_each_answered_and_the_server_goes_on(server, reference):
    rng = random.Random(1234)
    prompts = random_prompts(8, 2, 8, seed=11)
    want_long = expected_outputs(reference, prompts[:2], [greedy(1500)] * 2)
    want_short = expected_outputs(reference, prompts, [greedy(6)] * len(prompts))
    stop, checked, failures = threading.Event(), Counter(), []

    def well_behaved() -> None:  # a client whose requests must not notice the storm
        try:
            with RolloutClient(server.address, timeout=WAIT_S) as c:
                long = c.stream(prompts[:2], 1, greedy(1500))
                while not stop.is_set():
                    batch = c.generate(prompts, 1, greedy(6))
                    assert [[r.completion_ids] for r in batch] == want_short, [r.finish_reason for r in batch]
                    checked["short"] += 1
                    time.sleep(0.05)
                assert [[r.completion_ids] for r in long.result(WAIT_S)] == want_long
                checked["long"] += 1
        except BaseException as exc:  # noqa: BLE001 (reported on the test's thread)
            failures.append(exc)

    bystander = threading.Thread(target=well_behaved)
    bystander.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    outcomes: Counter[str] = Counter()
    try:
        sock.connect(server.address)
        send_frames(sock, rng, N_FRAMES, outcomes)
    finally:
        stop.set()
        bystander.join(2 * WAIT_S)
        sock.close()
        ctx.term()
    print(f"\nfuzz: {N_FRAMES} frames sent, outcomes {dict(sorted(outcomes.items()))}, bystander {dict(checked)}")
    assert not failures, (failures[0], "\n".join(server.output))
    assert checked["long"] == 1 and checked["short"] >= 1
    assert server.alive()
    errors = sum(v for k, v in outcomes.items() if k.startswith("error:"))
    assert errors >= N_FRAMES // 2 and "error:INTERNAL" not in outcomes
    assert {"error:MALFORMED", "error:BAD_SCHEMA", "error:UNKNOWN_KIND", "error:BAD_VERSION", "error:TOO_LARGE"} \
        <= set(outcomes)
    with RolloutClient(server.address, timeout=WAIT_S) as c:  # still serving, and right
        assert [[r.completion_ids] for r in c.generate(prompts, 1, greedy(6))] == want_short
        assert c.health().healthy and c.stats()["errors/MALFORMED"] >= outcomes["error:MALFORMED"]
