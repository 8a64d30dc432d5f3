"""The wire's bytes, pinned: every message recorded by `record_wire_golden.py` at the reference
commit decodes with today's code, encodes back to the same bytes, and builds again from the same
fields (its defaults included) to the same bytes. A change here is a protocol change: bump
PROTOCOL_VERSION, re-record, and say why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.wire.codec import decode, encode
from rollout.wire.kinds import PROTOCOL_VERSION

GOLDEN = json.loads(Path(__file__).with_name("wire_golden.json").read_text())


def test_the_protocol_version_is_the_recorded_one():
    assert GOLDEN["protocol_version"] == PROTOCOL_VERSION


@pytest.mark.parametrize("name", sorted(GOLDEN["messages"]))
def test_recorded_bytes_decode_encode_and_rebuild_unchanged(name):
    entry = GOLDEN["messages"][name]
    frame = bytes.fromhex(entry["frame"])
    msg = decode(frame)
    assert encode(msg) == frame
    if entry["given"]:
        rebuilt = type(msg)(**{field: getattr(msg, field) for field in entry["given"]})
        assert encode(rebuilt) == frame, f"{name}: a default changed"
