"""Context errors cross processes as msgpack'd dicts and come back as the same error."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.errors import (
    ActiveRequestCountOverflowError,
    BlockOverflowError,
    ContextErrorFactory,
    ContextOverflowError,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    TensorStateDeallocatedError,
    TokenOverflowError,
)

REQUEST_IDS = st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))
MESSAGES = st.one_of(st.none(), st.text(max_size=40))
COUNTS = st.integers(0, 2**32)

PLAIN_TYPES = [
    ContextOverflowError,
    RequestOverflowError,
    TokenOverflowError,
    BlockOverflowError,
    TensorStateDeallocatedError,
]


def _over_the_wire(error):
    return ContextErrorFactory.deserialize(msgpack.unpackb(msgpack.packb(ContextErrorFactory.serialize(error))))


def _assert_same(a, b):
    assert type(a) is type(b)
    assert (a.request_id, a.message, a.is_transient) == (b.request_id, b.message, b.is_transient)
    assert str(a) == str(b)


@settings(deadline=None)
@given(st.sampled_from(PLAIN_TYPES), REQUEST_IDS, MESSAGES, st.booleans())
def test_plain_errors_round_trip(error_type, request_id, message, is_transient):
    error = error_type(request_id, message, is_transient=is_transient)
    _assert_same(_over_the_wire(error), error)


@settings(deadline=None)
@given(REQUEST_IDS, MESSAGES)
def test_max_sequence_length_error_round_trips_and_is_never_transient(request_id, message):
    error = MaxSequenceLengthOverflowError(request_id, message, is_transient=True)
    assert not error.is_transient
    _assert_same(_over_the_wire(error), error)


@settings(deadline=None)
@given(COUNTS, COUNTS)
def test_active_request_count_error_round_trips(max_count, active_count):
    error = ActiveRequestCountOverflowError(max_count, active_count)
    back = _over_the_wire(error)
    _assert_same(back, error)
    assert (back.max_request_count, back.active_request_count) == (max_count, active_count)
    assert back.request_id is None and not back.is_transient


def test_every_error_type_is_covered():
    covered = set(PLAIN_TYPES) | {MaxSequenceLengthOverflowError, ActiveRequestCountOverflowError}
    assert covered == {ContextOverflowError, *_subclasses(ContextOverflowError)}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_serialized_form_is_plain_data():
    obj = ContextErrorFactory.serialize(BlockOverflowError(7, "no blocks", is_transient=False))
    assert obj == {"type": "BlockOverflowError", "request_id": 7, "message": "no blocks", "is_transient": False}


def test_refusals():
    with pytest.raises(TypeError):
        ContextErrorFactory.serialize(ValueError("not a context error"))
    with pytest.raises(ValueError):
        ContextErrorFactory.deserialize({"type": "KeyError", "request_id": 1, "message": "", "is_transient": True})
    with pytest.raises(ValueError):
        ContextErrorFactory.deserialize({"request_id": 1})
