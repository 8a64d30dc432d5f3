"""The wire protocol: round trips of every kind, every range refused by name, fuzzed frames."""

from __future__ import annotations

import math
import random

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.config import PauseMode, SuspendPolicy, UpdatePolicy
from inference.errors import ContextOverflowError, EngineStateError, MaxSequenceLengthOverflowError, OverloadedError
from inference.request import FinishReason, RequestOutput
from inference.sampling.params import (
    MAX_SAMPLES,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    LogprobsMode,
    SamplingParams,
)
from rollout.wire.codec import ProtocolError, decode, decode_reply, decode_request, encode
from rollout.wire.convert import (
    error_from_reply,
    error_reply,
    output_from_wire,
    output_to_wire,
)
from rollout.wire.kinds import (
    MAX_LEASE_SECONDS,
    MAX_REQUEST_ID_LENGTH,
    PROTOCOL_VERSION,
    REPLY_KINDS,
    ErrorCode,
    Kind,
)
from rollout.wire.kv_events import KvEvent, KvEventBatch, KvOp
from rollout.wire.messages import (
    Abort,
    Continue,
    DestroyWeightsUpdateGroup,
    ErrorReply,
    Generate,
    GetWeightVersion,
    Health,
    HealthInfo,
    Heartbeat,
    InitWeightsUpdateGroup,
    IsSleeping,
    KvEvents,
    ListLoras,
    LoadLora,
    Pause,
    ResetPrefixCache,
    Result,
    Resume,
    SampleOutput,
    Stats,
    Suspend,
    SyncLora,
    TokenDelta,
    UnloadLora,
    UpdateWeights,
    kind_of,
)
from weight_sync import DiskSource


def examples() -> list:
    """One message of every kind, optional fields filled in."""
    sampling = SamplingParams(n=4, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=2**64 - 1, max_tokens=8,
                              stop_token_ids=[2, 3], ignore_eos=True, logprobs=5, prompt_logprobs=0,
                              logprobs_mode=LogprobsMode.PROCESSED, repetition_penalty=1.3, presence_penalty=-2.0,
                              frequency_penalty=2.0, min_tokens=8, logit_bias={0: 100.0, 2**31: -100.0},
                              bad_words_token_ids=[[7], [8, 9, 10]], allowed_token_ids=[7, 8], cache_salt="")
    return [
        Generate(request_id="g-1", prompt_token_ids=[1, 5, 9], sampling=sampling, stream_tokens=True,
                 session_id="s", group_id="grp"),
        Abort(request_id="c-1", targets=["g-1", "g-2"]),
        Pause(request_id="c-2", mode=PauseMode.RETRACT),
        Continue(request_id="c-3"),
        Suspend(request_id="c-4", policy=SuspendPolicy.OFFLOAD, offload_weights=True),
        Resume(request_id="c-5"),
        UpdateWeights(request_id="c-6", source=DiskSource(path="/ckpt/step-7", version=7), policy=UpdatePolicy.KEEP),
        ResetPrefixCache(request_id="c-7"),
        Stats(request_id="c-8"),
        Health(request_id="c-9"),
        Heartbeat(request_id="c-10", lease_s=30.0),
        SampleOutput(request_id="g-1", sample_index=3, n=4, prompt_len=3, token_ids=[7, 8], logprobs=[-0.5, -1.25],
                     versions=[6, 7], finish_reason=FinishReason.LENGTH, top_logprobs=[{7: -0.5, 4: -2.0}, {8: -1.25}],
                     prompt_logprobs=[None, {5: -3.0}, {9: -0.25, 1: -4.0}], ttft=0.01, latency=0.2, num_preemptions=1),
        TokenDelta(request_id="g-1", sample_index=0, start=2, token_ids=[4], logprobs=[-0.75], versions=[7]),
        Result(request_id="c-9", request_kind=Kind.HEALTH, policy_version=7,
               stats={"steps": 3, "rate": 0.5, "mode": "x"},
               health=HealthInfo(healthy=True, seconds_since_loop_tick=0.01, state="running", policy_version=7),
               kv_events=KvEventBatch(block_size=16, start=5, next=8, reset=True, more=True, events=[
                   KvEvent(KvOp.STORED, [2**63 - 1, 1]), KvEvent(KvOp.REMOVED, [7]), KvEvent(KvOp.CLEARED)]),
               sleeping=False),
        ErrorReply(code=ErrorCode.CONTEXT_OVERFLOW, message="too long", request_id="g-1",
                   context_error={"type": "BlockOverflowError", "request_id": None, "message": "m",
                                  "is_transient": True}),
        KvEvents(request_id="c-11", since=5, max_events=128),
        IsSleeping(request_id="c-12"),
        LoadLora(request_id="c-13", lora_name="math", lora_path="/adapters/math"),
        UnloadLora(request_id="c-14", lora_name="math"),
        ListLoras(request_id="c-15"),
    ]


def weight_sync_examples() -> list:
    """The weight-update group's kinds, optional fields filled in."""
    return [
        InitWeightsUpdateGroup(request_id="c-21", master_address="127.0.0.1", master_port=29500, world_size=3,
                               rank_offset=1, group_name="wsync", backend="gloo", timeout_s=5.0),
        DestroyWeightsUpdateGroup(request_id="c-22", group_name="wsync"),
        GetWeightVersion(request_id="c-23"),
        SyncLora(request_id="c-24", source=adapter_source()),
    ]


def adapter_source():
    """A rank-4 q_proj adapter's tensors in shared memory (the names and buckets an adapter sync sends)."""
    import torch

    from weight_sync import AdapterSource, SharedMemorySource
    from weight_sync.buckets import manifest_for

    named = [(f"base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight", torch.zeros(s))
             for ab, s in (("A", (4, 32)), ("B", (32, 4)))]
    return AdapterSource(name="policy", rank=4, alpha=8.0, target_modules=["q_proj"],
                         payload=SharedMemorySource(manifest=manifest_for(named, version=2),
                                                    segment="rollout-wsync-1-0123456789abcdef", token=7))


EXAMPLES = examples() + weight_sync_examples()
FRAMES = [encode(m) for m in EXAMPLES]
RAW = [msgspec.msgpack.decode(f) for f in FRAMES]


def raw(msg) -> dict:
    """A message as a plain msgpack dict, to tamper with."""
    return msgspec.msgpack.decode(encode(msg))


def refused(obj, code: ErrorCode = ErrorCode.BAD_SCHEMA, **kwargs) -> ProtocolError:
    frame = obj if isinstance(obj, bytes) else msgspec.msgpack.encode(obj)
    with pytest.raises(ProtocolError) as info:
        decode(frame, **kwargs)
    assert info.value.code is code, info.value
    return info.value


# ---- round trips -----------------------------------------------------------------------------


def test_kinds_have_fixed_numbers_requests_low_replies_high():
    assert {k.name: k.value for k in Kind} == {
        "GENERATE": 1, "ABORT": 2, "PAUSE": 3, "CONTINUE": 4, "SUSPEND": 5, "RESUME": 6, "UPDATE_WEIGHTS": 7,
        "RESET_PREFIX_CACHE": 8, "STATS": 9, "HEALTH": 10, "HEARTBEAT": 11, "KV_EVENTS": 12,
        "SAMPLE_OUTPUT": 64, "TOKEN_DELTA": 65, "RESULT": 66, "ERROR": 67,
    } | {"INIT_WEIGHTS_UPDATE_GROUP": 13, "DESTROY_WEIGHTS_UPDATE_GROUP": 14, "GET_WEIGHT_VERSION": 15,
                                                                                   "IS_SLEEPING": 16,
         "LOAD_LORA": 17, "UNLOAD_LORA": 18, "LIST_LORAS": 19, "SYNC_LORA": 20}
    assert sorted(raw(m)["kind"] for m in EXAMPLES) == sorted(k.value for k in Kind)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips(msg):
    frame = encode(msg)
    back = decode(frame)
    assert type(back) is type(msg) and back == msg and not back != msg
    assert encode(back) == frame
    assert raw(msg)["v"] == PROTOCOL_VERSION
    is_reply = raw(msg)["kind"] >= 64
    assert (decode_reply if is_reply else decode_request)(frame) == msg
    err = pytest.raises(ProtocolError, decode_request if is_reply else decode_reply, frame).value
    assert err.code is ErrorCode.UNKNOWN_KIND and Kind(raw(msg)["kind"]).name in err.message


def test_packed_arrays_are_little_endian_views_with_their_dtypes():
    generate, sample = EXAMPLES[0], EXAMPLES[11]
    assert raw(generate)["prompt_token_ids"] == np.array([1, 5, 9], "<i4").tobytes()
    back = decode(encode(sample))
    assert back.token_ids.dtype == np.dtype("<i4") and back.logprobs.dtype == np.dtype("<f4")
    assert back.token_ids.tolist() == [7, 8] and back.logprobs.tolist() == [-0.5, -1.25]
    assert back.versions.tolist() == [6, 7] and not back.token_ids.flags.writeable
    assert back.top_logprobs == [{7: -0.5, 4: -2.0}, {8: -1.25}]
    assert decode(memoryview(FRAMES[11])) == decode(bytearray(FRAMES[11])) == sample  # zmq hands out buffers


def test_weight_source_is_tagged_for_later_transports():
    assert raw(EXAMPLES[6])["source"] == {"type": "safetensors_dir", "path": "/ckpt/step-7", "version": 7}


# ---- converters ------------------------------------------------------------------------------


def test_the_wire_carries_the_engines_sampling_params_and_refuses_unknown_fields():
    """No mirror: a Generate's sampling decodes as `SamplingParams` itself; a field it does not
    have is refused, as every struct's unknown field is (msgspec alone would drop it)."""
    msg = decode(encode(EXAMPLES[0]))
    assert type(msg.sampling) is SamplingParams and msg.sampling == EXAMPLES[0].sampling
    frame = raw(EXAMPLES[0])
    frame["sampling"]["top_n"] = 3
    err = refused(frame)
    assert "top_n" in err.message and "sampling" in err.message and err.request_id == "g-1"


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, MAX_SAMPLES), temperature=st.just(0.0) | st.floats(MIN_TEMPERATURE, 10),
       top_k=st.sampled_from([-1, 0, 1, 50]),
       top_p=st.floats(0, 1, exclude_min=True), min_p=st.floats(0, 1, exclude_max=True),
       seed=st.none() | st.integers(0, 2**64 - 1), max_tokens=st.integers(1, 2**31),
       stop=st.lists(st.integers(0, 2**31), max_size=4), ignore_eos=st.booleans(),
       logprobs=st.none() | st.integers(0, 100), prompt_logprobs=st.none() | st.integers(0, 100),
       mode=st.sampled_from(LogprobsMode),
       penalties=st.tuples(st.floats(1e-3, 1e3), st.floats(-2, 2), st.floats(-2, 2)),
       min_tokens=st.integers(0, 2**31),
       bias=st.none() | st.dictionaries(st.integers(0, 2**31), st.floats(-100, 100), max_size=4),
       bad=st.none() | st.lists(st.lists(st.integers(0, 2**31), min_size=1, max_size=3), max_size=3),
       allowed=st.none() | st.lists(st.integers(0, 2**31), min_size=1, max_size=4),
       salt=st.none() | st.text(max_size=256))
def test_sampling_params_round_trip(n, temperature, top_k, top_p, min_p, seed, max_tokens, stop, ignore_eos,
                                    logprobs, prompt_logprobs, mode, penalties, min_tokens, bias, bad, allowed, salt):
    params = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                            max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=ignore_eos, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, logprobs_mode=mode, repetition_penalty=penalties[0],
                            presence_penalty=penalties[1], frequency_penalty=penalties[2],
                            min_tokens=min(min_tokens, max_tokens), logit_bias=bias, bad_words_token_ids=bad,
                            allowed_token_ids=allowed, cache_salt=salt)
    msg = decode(encode(Generate(request_id="r", prompt_token_ids=[1], sampling=params)))
    assert msg.sampling == params


def test_engine_validation_refusal_is_invalid_request_naming_the_field():
    with pytest.raises(ValueError, match="^top_p"):
        SamplingParams(top_p=2.0)  # the engine's own type: never built out of range
    frame = raw(Generate(request_id="t", prompt_token_ids=[1]))
    tiny = frame | {"sampling": frame["sampling"] | {"temperature": 1e-40}}
    err = refused(tiny, ErrorCode.INVALID_REQUEST)  # in range for the schema, not for the sampler (found by fuzzing)
    assert err.message.startswith("sampling.temperature") and err.request_id == "t"
    above = frame | {"sampling": frame["sampling"] | {"max_tokens": 4, "min_tokens": 5}}
    err = refused(above, ErrorCode.INVALID_REQUEST)  # each in range, not together
    assert err.message.startswith("sampling.min_tokens") and err.request_id == "t"
    two = frame | {"sampling": frame["sampling"] | {"structured_outputs": {"regex": "a", "grammar": "b"}}}
    assert refused(two, ErrorCode.INVALID_REQUEST).message.startswith("sampling.structured_outputs")


@pytest.mark.parametrize("sampling", [{"repetition_penalty": 0.0}, {"presence_penalty": 2.5},
                                      {"frequency_penalty": -2.01}, {"logit_bias": {3: 101.0}},
                                      {"logit_bias": {-1: 1.0}}, {"bad_words_token_ids": [[]]},
                                      {"allowed_token_ids": []}, {"cache_salt": "s" * 257}])
def test_out_of_range_processor_fields_are_refused_by_the_schema(sampling):
    frame = raw(Generate(request_id="r", prompt_token_ids=[1]))
    refused(frame | {"sampling": frame["sampling"] | sampling})


def test_request_output_round_trips_to_a_rollout():
    out = RequestOutput(request_id=17, prompt_token_ids=[1, 2, 3], generated_token_ids=[4, 5, 6],
                        logprobs=[-0.5, -0.125, -2.0], token_versions=[3, 3, 4], finish_reason=FinishReason.STOP,
                        top_logprobs=[{4: -0.5}, {5: -0.125}, {6: -2.0}], sample_index=1, arrival_time=1.0,
                        first_token_time=1.5, finish_time=2.0, num_preemptions=2)
    msg = decode_reply(encode(output_to_wire(out, "client-7", n=2)))
    assert (msg.request_id, msg.n, msg.prompt_len, msg.ttft, msg.latency) == ("client-7", 2, 3, 0.5, 1.0)
    assert msg.top_logprobs == out.top_logprobs and msg.num_preemptions == 2
    rollout = output_from_wire(msg, [1, 2, 3], group=5)
    assert rollout.prompt_ids == [1, 2, 3] and rollout.completion_ids == [4, 5, 6]
    assert rollout.logprobs == out.logprobs and rollout.versions == [3, 3, 4]
    assert (rollout.finish_reason, rollout.group, rollout.sample_index) == (FinishReason.STOP, 5, 1)
    with pytest.raises(ValueError, match="prompt of 3 tokens"):
        output_from_wire(msg, [1, 2], group=5)


def test_errors_cross_the_wire_typed():
    overflow = MaxSequenceLengthOverflowError(None, "prompt (9) + max_tokens (9) > max_sequence_length (16)")
    back = error_from_reply(decode_reply(encode(error_reply(overflow, "g-3"))))
    assert type(back) is MaxSequenceLengthOverflowError and back.message == overflow.message
    assert not back.is_transient
    cases = [(EngineStateError("suspended"), ErrorCode.ENGINE_STATE),
             (ValueError("top_k bad"), ErrorCode.INVALID_REQUEST), (RuntimeError("boom"), ErrorCode.INTERNAL),
             (ProtocolError(ErrorCode.DUPLICATE, "id again"), ErrorCode.DUPLICATE),
             (OverloadedError("queue full"), ErrorCode.OVERLOADED)]
    for exc, code in cases:
        reply = decode_reply(encode(error_reply(exc, "g-3")))
        assert (reply.code, reply.request_id) == (code, "g-3")
        assert any(text in reply.message for text in ("suspended", "top_k bad", "boom", "id again", "queue full"))
        err = error_from_reply(reply)
        assert isinstance(err, ProtocolError) and err.code is code
    broken = ErrorReply(code=ErrorCode.CONTEXT_OVERFLOW, message="m", context_error={"type": "Nope"})
    assert isinstance(error_from_reply(broken), ProtocolError)
    assert not isinstance(error_from_reply(broken), ContextOverflowError)


# ---- refusals --------------------------------------------------------------------------------

NAN, INF = math.nan, math.inf
SAMPLING_CASES = [
    ("temperature", -0.5), ("temperature", NAN), ("temperature", INF), ("temperature", -INF),
    ("temperature", MAX_TEMPERATURE * 2), ("top_k", MAX_TOP_K + 1), ("top_k", 2**64 - 1),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", NAN), ("top_p", INF),
    ("min_p", -0.1), ("min_p", 1.0), ("min_p", NAN), ("min_p", INF),
    ("top_k", -2), ("top_k", 1.5), ("n", 0), ("n", MAX_SAMPLES + 1), ("max_tokens", 0), ("seed", -1), ("seed", 1.0),
    ("logprobs", -1), ("logprobs", 101), ("prompt_logprobs", 101), ("stop_token_ids", [1, -1]),
    ("logprobs_mode", 2), ("ignore_eos", 1), ("n", True),
]


@pytest.mark.parametrize("field,value", SAMPLING_CASES)
def test_each_sampling_range_is_refused_naming_the_field(field, value):
    frame = raw(EXAMPLES[0])
    frame["sampling"][field] = value
    err = refused(frame)
    assert f"sampling.{field}" in err.message and err.request_id == "g-1"


GENERATE_CASES = [
    ("request_id", ""), ("request_id", "x" * (MAX_REQUEST_ID_LENGTH + 1)), ("request_id", 5),
    ("prompt_token_ids", b"\x01\x00\x00"), ("prompt_token_ids", b""), ("prompt_token_ids", [1, 2]),
    ("prompt_token_ids", np.array([3, -1], "<i4").tobytes()), ("stream_tokens", 1), ("session_id", 3),
    ("sampling", [1]), ("unexpected", 1),
]


@pytest.mark.parametrize("field,value", GENERATE_CASES)
def test_generate_fields_are_refused_naming_the_field(field, value):
    frame = raw(EXAMPLES[0])
    frame[field] = value
    assert field in refused(frame).message


@pytest.mark.parametrize("msg,field,value", [
    (EXAMPLES[10], "lease_s", NAN), (EXAMPLES[10], "lease_s", INF), (EXAMPLES[10], "lease_s", 0.0),
    (EXAMPLES[10], "lease_s", MAX_LEASE_SECONDS + 1), (EXAMPLES[2], "mode", "sideways"),
    (EXAMPLES[4], "policy", "keep"), (EXAMPLES[6], "policy", "offload"), (EXAMPLES[1], "targets", []),
    (EXAMPLES[11], "logprobs", np.array([-1.0], "<f4").tobytes()),  # 1 log-prob for 2 tokens
    (EXAMPLES[11], "versions", b"\x00" * 7), (EXAMPLES[11], "top_logprobs", [{7: -0.5}]),
    (EXAMPLES[11], "prompt_logprobs", [None]), (EXAMPLES[11], "sample_index", 4),
    (EXAMPLES[11], "finish_reason", "tired"), (EXAMPLES[11], "ttft", NAN),
    (EXAMPLES[12], "token_ids", np.array([4, 5], "<i4").tobytes()), (EXAMPLES[13], "request_kind", 40),
    (EXAMPLES[14], "code", 99), (EXAMPLES[14], "context_error", {"nested": [1]}),
    (EXAMPLES[15], "max_events", 0), (EXAMPLES[15], "since", -1),
    (EXAMPLES[13], "kv_events", {"block_size": 4, "start": 0, "next": 1, "events": [[1, [0]]]}),  # hash 0: no parent
    (EXAMPLES[13], "kv_events", {"block_size": 4, "start": 0, "next": 1, "events": [[1, [2**63]]]}),
    (EXAMPLES[13], "kv_events", {"block_size": 4, "start": 0, "next": 1, "events": [[9, []]]}),
])
def test_other_fields_are_refused_naming_the_field(msg, field, value):
    frame = raw(msg)
    frame[field] = value
    assert field in refused(frame).message


def test_other_version_is_refused_naming_both_versions():
    newer = Generate(request_id="g-9", prompt_token_ids=[1], v=PROTOCOL_VERSION + 1)
    err = refused(encode(newer), ErrorCode.BAD_VERSION)
    assert f"version {PROTOCOL_VERSION + 1}" in err.message and f"version {PROTOCOL_VERSION}" in err.message
    assert err.request_id == "g-9"
    future = raw(EXAMPLES[0]) | {"v": PROTOCOL_VERSION + 1, "new_field": 1, "sampling": "changed"}  # unknown schema
    assert f"version {PROTOCOL_VERSION + 1}" in refused(future, ErrorCode.BAD_VERSION).message
    assert "no protocol version" in refused({"kind": 1, "request_id": "a"}, ErrorCode.BAD_VERSION).message


def test_a_message_without_a_version_is_refused_not_taken_as_this_one():
    # NOTE: each struct's default `v` is this side's version: a writer that names none must not get it
    for msg, frame in zip(EXAMPLES, RAW):
        unversioned = {k: val for k, val in frame.items() if k != "v"}
        err = refused(unversioned, ErrorCode.BAD_VERSION)
        assert "no protocol version" in err.message and err.request_id == getattr(msg, "request_id", None)
        side = decode_reply if kind_of(type(msg)) in REPLY_KINDS else decode_request
        with pytest.raises(ProtocolError) as info:
            side(msgspec.msgpack.encode(unversioned))
        assert info.value.code is ErrorCode.BAD_VERSION


def test_size_limit_is_checked_before_parsing():
    frame = FRAMES[0]
    assert decode(frame, max_frame_bytes=len(frame)) == EXAMPLES[0]
    assert str(len(frame)) in refused(frame, ErrorCode.TOO_LARGE, max_frame_bytes=len(frame) - 1).message
    refused(b"\xc1" * 4096, ErrorCode.TOO_LARGE, max_frame_bytes=1024)  # garbage, but too large first
    big = Generate(request_id="big", prompt_token_ids=np.ones(1000, "<i4"))
    with pytest.raises(ProtocolError) as info:
        encode(big, max_frame_bytes=1000)
    assert info.value.code is ErrorCode.TOO_LARGE and info.value.request_id == "big"


def test_malformed_and_unknown_frames():
    for frame in [b"", b"\xc1", b"\x93\x01\x02\x03", b"\x05", b"\x91" * 100_000 + b"\x00",
                  b"\x82\xa4kind\x01\xa1z" + b"\x91" * 100_000 + b"\x00", FRAMES[0][:-3]]:
        refused(frame, ErrorCode.MALFORMED)
    assert "99" in refused({"kind": 99, "v": PROTOCOL_VERSION}, ErrorCode.UNKNOWN_KIND).message
    refused({"kind": "generate", "v": PROTOCOL_VERSION}, ErrorCode.UNKNOWN_KIND)
    refused({"v": PROTOCOL_VERSION}, ErrorCode.UNKNOWN_KIND)
    with pytest.raises(ProtocolError) as info:
        decode("not bytes")  # type: ignore[arg-type]
    assert info.value.code is ErrorCode.MALFORMED


# ---- fuzz: any bytes decode to a message or raise ProtocolError ------------------------------


def decodes_or_refuses(frame: bytes) -> None:
    try:
        msg = decode(frame)
    except ProtocolError as err:
        assert err.code is not ErrorCode.INTERNAL, err  # an unforeseen exception inside decode
        assert err.message
        return
    frame = encode(msg)  # whatever was accepted is a valid message, and reads back the same
    assert encode(decode(frame)) == frame, msg


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz(2000)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(frame):
    decodes_or_refuses(frame)


@fuzz(2000)
@given(st.integers(0, 2**64 - 1))
def test_fuzz_mutated_valid_frames(seed):
    rng = random.Random(seed)  # NOTE: one drawn seed per example keeps hypothesis's own cost low
    data = bytearray(rng.choice(FRAMES))
    for _ in range(rng.randint(1, 4)):
        pos, blob = rng.randrange(len(data) + 1), rng.randbytes(rng.randint(1, 4))
        op = rng.choice("fidt")
        if op == "f" and pos < len(data):  # flip bits of a byte
            data[pos] ^= blob[0] or 0xFF
        elif op == "i":
            data[pos:pos] = blob
        elif op == "d":
            del data[pos : pos + len(blob)]
        elif op == "t":
            del data[pos:]
        if not data:
            return
    decodes_or_refuses(bytes(data))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4) | st.integers(-(2**63), 2**64 - 1), inner, max_size=3),
    max_leaves=8,
)


@fuzz(400)
@given(st.sampled_from(RAW), st.dictionaries(st.sampled_from(
    ["kind", "v", "request_id", "sampling", "prompt_token_ids", "token_ids", "logprobs", "versions", "top_logprobs",
     "n", "sample_index", "mode", "source", "stats", "health", "code", "context_error", "extra"]), msgpack_values,
    max_size=3))
def test_fuzz_valid_frames_with_random_field_values(fields, changes):
    decodes_or_refuses(msgspec.msgpack.encode(fields | changes))


def weight_sources() -> list:
    import torch

    from weight_sync import DistributedSource, SharedMemorySource
    from weight_sync.buckets import fill_checksums, manifest_for
    from weight_sync.sources import CudaIpcBuffer

    named = [("model.norm.weight", torch.ones(4)), ("model.embed_tokens.weight", torch.ones(3, 4).bfloat16())]
    manifest = manifest_for(named, bucket_bytes=64, version=9)
    fill_checksums(manifest, [t for _, t in named])
    ipc = CudaIpcBuffer(0, b"h", 128, 0, 0, b"r", 0, b"e", True)
    return [
        DistributedSource(manifest=manifest, group_name="wsync", finish=False, staging="in_place"),
        DistributedSource(manifest=manifest_for(named, packed=False)),
        SharedMemorySource(manifest=manifest, segment="rollout-wsync-1-0123456789abcdef", token=7),
        SharedMemorySource(manifest=manifest, cuda_ipc=[ipc, ipc]),
    ]


@pytest.mark.parametrize("source", weight_sources(), ids=lambda s: type(s).__name__)
def test_weight_sources_round_trip_in_update_weights(source):
    msg = UpdateWeights(request_id="c-6", source=source)
    back = decode(encode(msg))
    assert back == msg and back.source.manifest.total_bytes == source.manifest.total_bytes


def test_a_disk_source_with_a_negative_version_is_refused():
    frame = raw(EXAMPLES[6])
    frame["source"]["version"] = -1
    assert "version" in refused(frame).message


def test_bad_weight_sources_are_refused_by_schema():
    (good, _, shm, _) = weight_sources()
    frame = raw(UpdateWeights(request_id="c-6", source=good))
    frame["source"]["manifest"]["shapes"][0] = [100]  # no longer fits its bucket
    assert "layout" in refused(frame).message
    frame = raw(UpdateWeights(request_id="c-6", source=shm))
    frame["source"]["segment"] = "../../etc/passwd"
    assert "not one of ours" in refused(frame).message
    frame = raw(UpdateWeights(request_id="c-6", source=shm))
    frame["source"]["manifest"]["layout"]["buckets"][0][3] = -1  # a checksum is unsigned
    refused(frame)
    frame = raw(InitWeightsUpdateGroup(request_id="c", master_address="h", master_port=1, world_size=2))
    frame["backend"] = "mpi"
    refused(frame)
