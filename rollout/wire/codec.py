"""Wire protocol of the ZMQ rollout service: framing, versioning, encode / decode.

Framing. A client's DEALER socket sends one message per ZMQ frame; the server's ROUTER sees
`[identity, frame]` and answers with `[identity, frame]`. A frame is one msgpack map encoded
from one of the `msgspec.Struct`s of `rollout.wire.messages` (re-exported here: the schema is the
type); its `kind` field (a `Kind`: requests below 64, replies from 64) selects the schema.
Token ids, log-probs and versions travel as packed little-endian arrays (`rollout.wire.packing`).
Never pickle.

Versioning. Every message carries `v`, its writer's `PROTOCOL_VERSION`. Peers must speak the
same version: any change to a schema (a field or kind added, removed or retyped) bumps it, and
a message of another version, or with no `v` at all, is refused with `BAD_VERSION`, naming
both. Unknown fields are refused as well, so a mismatch never passes silently.

Size limit. `decode` refuses a frame longer than `max_frame_bytes` (`DEFAULT_MAX_FRAME_BYTES`)
before parsing a byte of it, and `encode` refuses to write one; the server should give its
socket the same limit (`zmq.MAXMSGSIZE`).

Conversation. Every request carries a `request_id` chosen by its client, unique within the
client's session. A `Generate` is answered by `n` `SampleOutput`s, each as its sample finishes,
preceded by `TokenDelta`s when `stream_tokens` is set; any other request by one `Result`. Any
request may instead be answered by one `ErrorReply`. Exactly once: a `Generate` whose id the
server already holds (in flight, or finished and retained) is not run again; its outputs go to
the newest sender, so a client that resubmits every unanswered request after a reconnect gets
each sample once (`TokenDelta.start` lets it drop repeated deltas); an id reused for a different
request is answered `DUPLICATE`. Heartbeats are the client's lease: when none arrives within
`lease_s`, the server aborts that client's requests.

Errors. `decode` returns a message or raises `ProtocolError`, whatever the bytes. The server
turns any exception into a reply with `rollout.wire.convert.error_reply`; the client turns it back
with `error_from_reply` (a context overflow comes back as its typed `ContextOverflowError`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import msgspec

from inference.sampling.params import SamplingParams
from rollout.wire.kinds import MAX_REQUEST_ID_LENGTH, PROTOCOL_VERSION, REPLY_KINDS, REQUEST_KINDS, ErrorCode, Kind
from rollout.wire.messages import Generate, Message, ReplyMessage, RequestMessage, _Message
from rollout.wire.packing import dec_hook, enc_hook

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "ProtocolError", "decode", "decode_reply", "decode_request", "encode"]

DEFAULT_MAX_FRAME_BYTES = 64 * 2**20  # a 32k-token sample with top-20 log-probs is ~6 MiB


class ProtocolError(Exception):
    """A frame or request refused, with a stable `code`, a message naming the problem, and the
    request id when it could be read (so the server can address its `ErrorReply`)."""

    def __init__(self, code: ErrorCode, message: str, request_id: Optional[str] = None):
        self.code = ErrorCode(code)
        self.message = message
        self.request_id = request_id
        super().__init__(f"{self.code.name}: {message}")


# ---- encode / decode -------------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder(enc_hook=enc_hook)
_DECODERS = {
    "message": (msgspec.msgpack.Decoder(Message, dec_hook=dec_hook), frozenset(Kind)),
    "request": (msgspec.msgpack.Decoder(RequestMessage, dec_hook=dec_hook), REQUEST_KINDS),
    "reply": (msgspec.msgpack.Decoder(ReplyMessage, dec_hook=dec_hook), REPLY_KINDS),
}
_KIND_VALUES = frozenset(k.value for k in Kind)


class _Envelope(msgspec.Struct):
    """The fields read to explain a frame that failed its schema (the others are skipped)."""

    kind: Any = None
    v: Any = None
    request_id: Any = None
    sampling: msgspec.Raw = msgspec.Raw()  # a Generate's, read for its keys only (empty: none)


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_KEYS = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# NOTE: a ValueError of the engine's own validation (`SamplingParams.__post_init__`, what a declared
# range cannot say) surfaces at the sampling or its structured outputs; it is the engine's refusal
_ENGINE_RULE = re.compile(r" - at `\$\.sampling(?:\.structured_outputs)?`$")
# NOTE: besides DecodeError, msgspec raises RecursionError for input nested too deep,
# UnicodeDecodeError for a map key that is not UTF-8 and TypeError for a map used as a map key
# (where a field takes any value: the envelope's, or a packed array's before its dec_hook).
_UNPARSABLE = (msgspec.DecodeError, RecursionError, UnicodeDecodeError, TypeError)


def encode(msg: _Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """One message as one frame; `ProtocolError(TOO_LARGE)` if the frame would exceed the limit.

    msgspec checks no constraint here (only at decode): build requests from validated values.
    """
    if not isinstance(msg, _Message):
        raise TypeError(f"encode: expected a protocol message, got {type(msg).__name__}")
    frame = _ENCODER.encode(msg)
    if len(frame) > max_frame_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{type(msg).__name__} encodes to {len(frame)} bytes, "
                            f"over the frame limit of {max_frame_bytes}", getattr(msg, "request_id", None))
    return frame


def decode(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Any message from one frame. Raises only `ProtocolError`, whatever the bytes."""
    return _decode(frame, max_frame_bytes, "message")


def decode_request(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> RequestMessage:
    """A client's request (the server's decoder): a reply kind is refused as UNKNOWN_KIND."""
    return _decode(frame, max_frame_bytes, "request")


def decode_reply(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ReplyMessage:
    """A server's reply (the client's decoder): a request kind is refused as UNKNOWN_KIND."""
    return _decode(frame, max_frame_bytes, "reply")


def _decode(frame: bytes, max_frame_bytes: int, expected: str) -> Any:
    try:
        size = memoryview(frame).nbytes
    except TypeError:
        raise ProtocolError(ErrorCode.MALFORMED, f"a frame is bytes, got {type(frame).__name__}") from None
    if size > max_frame_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {size} bytes is over the limit of {max_frame_bytes}")
    decoder, kinds = _DECODERS[expected]
    try:
        msg = decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise _explain(frame, exc, expected, kinds) from None
    except _UNPARSABLE as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"not a msgpack message: {exc}") from None
    except Exception as exc:  # a bug of ours; the server must still not die of one frame
        raise ProtocolError(ErrorCode.INTERNAL, f"decoding failed: {type(exc).__name__}: {exc}") from exc
    if msg.v != PROTOCOL_VERSION:
        raise _version_error(msg.v, getattr(msg, "request_id", None))
    env = _ENVELOPE.decode(frame)
    if env.v is None:
        # NOTE: a message struct fills a missing `v` with its default (this side's version), so
        # whether the writer named one is read from the frame itself; the envelope skips every
        # other field (a packed array in O(1)), a small cost next to the decode above.
        raise _version_error(None, getattr(msg, "request_id", None))
    if len(env.sampling) and isinstance(msg, Generate):
        # NOTE: msgspec drops a dataclass's unknown fields; the wire refuses them, as every struct's
        try:
            unknown = sorted(set(_KEYS.decode(env.sampling)) - _SAMPLING_FIELDS)
        except (msgspec.ValidationError, *_UNPARSABLE):  # NOTE: a key that is not UTF-8 text
            unknown = ["(not a string)"]
        if unknown:
            raise ProtocolError(ErrorCode.BAD_SCHEMA, f"{Kind.GENERATE.name}: Object contains unknown field "
                                f"`{unknown[0]}` - at `$.sampling`", msg.request_id)
    return msg


def _version_error(v: Any, request_id: Optional[str]) -> ProtocolError:
    got = "no protocol version `v`" if v is None else f"protocol version {v!r}"
    return ProtocolError(ErrorCode.BAD_VERSION, f"{got} received, this side speaks version {PROTOCOL_VERSION}",
                         request_id)


def _explain(frame: bytes, error: msgspec.ValidationError, expected: str, kinds: frozenset) -> ProtocolError:
    """Tell a wrong version or kind from a wrong field, for a frame that failed its schema, and a
    sampling the engine's own rules refuse (INVALID_REQUEST, as the engine says it in process)."""
    problem = str(error)
    try:
        env = _ENVELOPE.decode(frame)
    except _UNPARSABLE:
        return ProtocolError(ErrorCode.MALFORMED, f"not a message map: {problem}")
    rid = env.request_id
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_LENGTH else None
    if type(env.v) is not int or env.v != PROTOCOL_VERSION:
        return _version_error(env.v, rid)
    if type(env.kind) is not int or env.kind not in _KIND_VALUES:
        return ProtocolError(ErrorCode.UNKNOWN_KIND, f"unknown message kind {env.kind!r}", rid)
    kind = Kind(env.kind)
    if kind not in kinds:
        return ProtocolError(ErrorCode.UNKNOWN_KIND, f"kind {kind.value} ({kind.name}) is not a {expected}", rid)
    if isinstance(error.__cause__, ValueError) and _ENGINE_RULE.search(problem):
        return ProtocolError(ErrorCode.INVALID_REQUEST, f"sampling.{error.__cause__}", rid)
    return ProtocolError(ErrorCode.BAD_SCHEMA, f"{kind.name}: {problem}", rid)
