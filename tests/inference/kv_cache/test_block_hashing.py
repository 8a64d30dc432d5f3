"""`block_hashes`: stable, positive 63-bit, parent-chained, namespaced, full blocks only."""

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.kv_cache import hashing
from inference.kv_cache.hashing import NO_PARENT, block_hashes

TOKENS = st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=40)
SMALL_TOKENS = st.lists(st.integers(0, 3), max_size=40)
BLOCK_SIZES = st.integers(1, 8)
EXTRA_KEYS = st.one_of(
    st.none(),
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.tuples(st.integers(0, 9), st.text(max_size=3)),
)

# Inputs hashed both here and in child interpreters with other PYTHONHASHSEEDs.
CROSS_PROCESS_CASES = [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, NO_PARENT, None),
    ([0] * 16, 1, NO_PARENT, None),
    ([10, -3, 2**62, 7], 2, 12345, None),
    ([5, 6, 7, 8], 2, NO_PARENT, "lora-adapter"),
    ([5, 6, 7, 8], 2, NO_PARENT, b"\x00\xff"),
    ([5, 6, 7, 8], 2, NO_PARENT, (3, "policy-v2", b"x")),
]

# NOTE: the child loads hashing.py by path, skipping the package (and its torch import) for speed.
_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("hashing_under_test", sys.argv[2])
hashing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hashing)
block_hashes = hashing.block_hashes
cases = json.loads(sys.argv[1])
out = []
for tokens, bs, parent, key in cases:
    if isinstance(key, dict):
        key = bytes.fromhex(key["hex"])
    elif isinstance(key, list):
        key = tuple(bytes.fromhex(k["hex"]) if isinstance(k, dict) else k for k in key)
    out.append(block_hashes(tokens, bs, parent_hash=parent, extra_key=key))
print(json.dumps(out))
"""


def _jsonable(key):
    if isinstance(key, bytes):
        return {"hex": key.hex()}
    if isinstance(key, tuple):
        return [_jsonable(k) for k in key]
    return key


@pytest.mark.parametrize("seed", ["0", "1", "4242"])
def test_hashes_are_stable_across_processes(seed):
    cases = [(t, bs, p, _jsonable(k)) for t, bs, p, k in CROSS_PROCESS_CASES]
    env = dict(os.environ, PYTHONHASHSEED=seed)
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases), hashing.__file__],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    expected = [block_hashes(t, bs, parent_hash=p, extra_key=k) for t, bs, p, k in CROSS_PROCESS_CASES]
    assert json.loads(result.stdout) == expected


def test_hashes_are_pinned():
    """The digests themselves: a change to how a block is hashed (byte layout, key encoding, the
    0 remap) would orphan every hash a router or a remote cache learnt from an older engine."""
    assert block_hashes(list(range(40)), 4, 7, (3, "s")) == [
        1625859738102857377, 5566595697732766925, 7928502323598441253, 8687355917860815396, 5899023106580338111,
        8022565422471038523, 669424282653390892, 2211617356922253996, 60673452152920483, 7283251156319557929]
    assert block_hashes(list(range(9)), 4) == [2141542520064864664, 6154036696642149100]


@settings(deadline=None)
@given(TOKENS, BLOCK_SIZES, EXTRA_KEYS)
def test_one_positive_63_bit_hash_per_full_block(tokens, block_size, extra_key):
    hashes = block_hashes(tokens, block_size, extra_key=extra_key)
    assert len(hashes) == len(tokens) // block_size
    assert all(isinstance(h, int) and 0 < h < 2**63 for h in hashes)


@settings(deadline=None)
@given(SMALL_TOKENS, BLOCK_SIZES, st.data())
def test_partial_block_gets_no_hash(tokens, block_size, data):
    full = len(tokens) // block_size
    extra = data.draw(st.integers(1, block_size - 1)) if block_size > 1 else 0
    padded = tokens[: full * block_size] + [7] * extra
    assert block_hashes(padded, block_size) == block_hashes(tokens[: full * block_size], block_size)


def test_partial_block_examples():
    assert block_hashes([1, 2, 3], 4) == []
    assert block_hashes([], 4) == []
    assert block_hashes([1, 2, 3, 4, 5], 4) == block_hashes([1, 2, 3, 4], 4)


def test_parent_hash_continues_a_chain():
    tokens = list(range(20))
    head = block_hashes(tokens[:8], 4)
    tail = block_hashes(tokens[8:], 4, parent_hash=head[-1])
    assert head + tail == block_hashes(tokens, 4)


@settings(deadline=None)
@given(SMALL_TOKENS, BLOCK_SIZES, st.data(), EXTRA_KEYS)
def test_parent_hash_continues_a_chain_at_any_block_boundary(tokens, block_size, data, extra_key):
    whole = block_hashes(tokens, block_size, extra_key=extra_key)
    split = data.draw(st.integers(0, len(whole)))
    head = block_hashes(tokens[: split * block_size], block_size, extra_key=extra_key)
    parent = head[-1] if head else NO_PARENT
    tail = block_hashes(tokens[split * block_size :], block_size, parent_hash=parent, extra_key=extra_key)
    assert head + tail == whole


@settings(deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=24), BLOCK_SIZES, EXTRA_KEYS, EXTRA_KEYS)
def test_extra_key_namespaces_the_whole_chain(tokens, block_size, key_a, key_b):
    a = block_hashes(tokens, block_size, extra_key=key_a)
    b = block_hashes(tokens, block_size, extra_key=key_b)
    if key_a == key_b and type(key_a) is type(key_b):
        assert a == b
    else:
        assert not set(a) & set(b)


def test_extra_key_examples():
    tokens = [1, 2, 3, 4]
    plain = block_hashes(tokens, 2)
    assert block_hashes(tokens, 2, extra_key=None) == plain
    assert block_hashes(tokens, 2, extra_key="a") == block_hashes(tokens, 2, extra_key="a")
    assert not set(block_hashes(tokens, 2, extra_key="a")) & set(plain)
    assert not set(block_hashes(tokens, 2, extra_key="a")) & set(block_hashes(tokens, 2, extra_key="b"))


@settings(deadline=None)
@given(SMALL_TOKENS, SMALL_TOKENS, BLOCK_SIZES)
def test_a_hash_is_determined_by_the_whole_prefix(tokens_a, tokens_b, block_size):
    """Block i of two sequences share a hash iff their first (i + 1) blocks are equal."""
    a = block_hashes(tokens_a, block_size)
    b = block_hashes(tokens_b, block_size)
    for i in range(min(len(a), len(b))):
        same_prefix = tokens_a[: (i + 1) * block_size] == tokens_b[: (i + 1) * block_size]
        assert (a[i] == b[i]) == same_prefix


def test_equal_blocks_at_different_positions_hash_differently():
    hashes = block_hashes([3, 3, 3, 3, 3, 3], 2)
    assert len(set(hashes)) == 3


def test_parent_hash_changes_every_hash():
    assert not set(block_hashes([1, 2, 3, 4], 2, parent_hash=99)) & set(block_hashes([1, 2, 3, 4], 2))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(block_size=0), ValueError),
        (dict(block_size=-1), ValueError),
        (dict(block_size=2, parent_hash=-1), ValueError),
        (dict(block_size=2, extra_key={1, 2}), TypeError),
        (dict(block_size=2, extra_key=object()), TypeError),
    ],
)
def test_invalid_arguments_are_refused(kwargs, error):
    with pytest.raises(error):
        block_hashes([1, 2, 3, 4], **kwargs)
