"""The delta codec and its manifest: any change round-trips bit for bit, the encoder picks the
smallest encoding, bytes that do not decode are a `DeltaError`, and the full-weights hash sees
what an additive checksum cannot (swapped words, swapped or renamed tensors)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.delta_codec import CHUNK_BYTES, apply_delta, encode_delta, encode_mixed
from weight_sync.delta_manifest import DeltaError, DeltaManifest, Encoding, TensorChange
from weight_sync.manifest import ManifestError
from weight_sync.weights_hash import weights_hash


def changed_copy(base: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    new = base.clone()
    mask = torch.rand(base.shape, generator=gen) < fraction
    new[mask] += torch.randn(int(mask.sum()), generator=gen).to(base.dtype)
    return new


def changed_at(base: torch.Tensor, *indices: int) -> torch.Tensor:
    new = base.clone()
    for i in indices:
        new.view(torch.int16)[i] ^= 1  # the lowest mantissa bit: what an lr 1e-6 step flips
    return new


def random_bits(n: int) -> torch.Tensor:
    return torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16).view(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def round_trip(base: list[torch.Tensor], new: list[torch.Tensor]) -> list[TensorChange]:
    changes, payload = encode_delta(base, new)
    into_new = {i: (torch.full_like(b, float("nan")), b) for i, b in enumerate(base)}  # a buffer holding anything
    in_place = {i: (c, c) for i, c in enumerate(b.clone() for b in base)}
    for targets in (into_new, in_place):
        apply_delta(targets, changes, payload)
        for i, t in enumerate(new):
            assert torch.equal(bits(targets[i][0]), bits(t)), f"tensor {i} differs after apply"
    return changes


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float32]), sizes=st.lists(st.integers(1, 3000), min_size=1,
       max_size=4), fraction=st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_any_change_round_trips_bit_for_bit(dtype, sizes, fraction, seed):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    new = [changed_copy(b, fraction, seed + i) for i, b in enumerate(base)]
    changes = round_trip(base, new)
    for c, b, t in zip(changes, base, new):
        assert (c.encoding is Encoding.UNCHANGED) == torch.equal(bits(b), bits(t))
        assert c.count == int((bits(b) != bits(t)).sum())


def test_a_tensor_larger_than_a_chunk_round_trips_and_nan_bits_count_as_bits():
    base = torch.randn(3 * CHUNK_BYTES // 2 + 7).bfloat16()
    new = changed_copy(base, 0.01, 1)
    new[5] = float("nan")
    base[6] = float("nan")  # NOTE: NaN != NaN as floats; as bits, an unchanged NaN is unchanged
    new[6] = base[6]
    (change,) = round_trip([base], [new])
    assert change.encoding is Encoding.XOR_ZSTD


def test_the_encoder_picks_the_smallest_encoding():
    base = [torch.randn(200_000).bfloat16() for _ in range(3)] + [torch.ones(576).bfloat16()]
    new = [changed_copy(base[0], 0.01, 1), random_bits(200_000), base[2].clone(), base[3].clone()]
    new[3][7] = 2.0
    changes = round_trip(base, new)
    assert [c.encoding for c in changes] == [Encoding.XOR_ZSTD, Encoding.FULL, Encoding.UNCHANGED, Encoding.SPARSE]
    assert changes[0].nbytes < 0.03 * 2 * 200_000 and changes[3].nbytes == 6


def delta_of(base, new, **overrides) -> DeltaManifest:
    changes, payload = encode_delta(base, new)
    fields = dict(names=[f"t{i}" for i in range(len(new))], dtypes=["bfloat16"] * len(new),
                  shapes=[list(t.shape) for t in new], changes=changes, base_version=3, version=4,
                  weights_hash=weights_hash([f"t{i}" for i in range(len(new))], new), payload_bytes=payload.numel())
    return DeltaManifest(**{**fields, **overrides}), payload


def test_bytes_that_do_not_decode_are_a_delta_error():
    base = [torch.randn(50_000).bfloat16(), torch.randn(1000).bfloat16()]
    new = [changed_copy(base[0], 0.01, 1), changed_at(base[1], 3, 500)]
    delta, payload = delta_of(base, new)
    assert [c.encoding for c in delta.changes] == [Encoding.XOR_ZSTD, Encoding.SPARSE]
    corrupt = payload.clone()
    corrupt[delta.changes[0].offset + 40] ^= 0xFF
    with pytest.raises(DeltaError):
        apply_delta({0: (base[0].clone(), base[0])}, delta.changes, corrupt)
    short = list(delta.changes)
    short[0] = TensorChange(Encoding.XOR_ZSTD, short[0].count, short[0].offset, short[0].nbytes - 8)
    with pytest.raises(DeltaError, match="short|decode"):
        apply_delta({0: (base[0].clone(), base[0])}, short, payload)
    index = payload.clone()
    at = delta.changes[1].offset
    index[at : at + 4] = torch.tensor([0xFF] * 4, dtype=torch.uint8)  # element 2**32 - 1 of a tensor of 1000
    with pytest.raises(DeltaError, match="indexes element"):
        apply_delta({1: (base[1].clone(), base[1])}, delta.changes, index)


def test_a_delta_manifest_that_contradicts_itself_is_refused_at_decode():
    base = [torch.randn(1000).bfloat16()]
    delta, _ = delta_of(base, [changed_at(base[0], 10)])
    assert delta.changes[0].encoding is Encoding.SPARSE
    raw = msgspec.to_builtins(delta, builtin_types=(bytes,))
    decode = msgspec.msgpack.Decoder(DeltaManifest).decode
    assert decode(msgspec.msgpack.encode(raw)) == delta
    bad = [
        {**raw, "changes": [[1, delta.changes[0].count, 0, 5]]},  # SPARSE bytes != count * 6
        {**raw, "changes": [[2, 1, raw["payload_bytes"], 8]]},  # past the payload
        {**raw, "version": 3},  # not after its base
        {**raw, "names": ["t0", "t0"], "dtypes": ["bfloat16"] * 2, "shapes": [[1000]] * 2},
        {**raw, "weights_hash": b"short"},
    ]
    for fields in bad:
        with pytest.raises((ManifestError, msgspec.ValidationError)):
            decode(msgspec.msgpack.encode(fields))


def test_the_full_weights_hash_sees_swaps_and_renames_an_additive_sum_misses():
    a, b = torch.randn(64).bfloat16(), torch.randn(64).bfloat16()
    h = weights_hash(["a", "b"], [a, b])
    assert h == weights_hash(["a", "b"], [a.clone(), b.clone()])
    assert h != weights_hash(["b", "a"], [b, a])  # two tensors in the other order
    assert h != weights_hash(["a", "c"], [a, b])  # a renamed tensor
    words = a.view(torch.int64).clone()
    swapped = words.flip(0).view(torch.bfloat16)  # the same words (the same word sum), another order
    assert int(words.sum()) == int(swapped.view(torch.int64).sum())
    assert weights_hash(["a", "b"], [swapped, b]) != h
    assert np.frombuffer(h, dtype=np.uint8).size == 16


def test_one_mixed_payload_serves_the_replicas_on_the_base_and_those_that_need_it_in_full():
    base = [torch.randn(20_000).bfloat16(), torch.ones(64).bfloat16()]
    new = [changed_copy(base[0], 0.01, 1), changed_at(base[1], 2)]
    delta, full, payload = encode_mixed(base, new)
    assert [c.encoding for c in full] == [Encoding.FULL] * 2
    assert all(c.offset >= max(d.offset + d.nbytes for d in delta) for c in full)  # the full section follows
    elsewhere = [torch.randn(20_000).bfloat16(), torch.zeros(64).bfloat16()]  # a replica on other weights
    for changes, start in ((delta, base), (full, elsewhere)):
        targets = {i: (torch.empty_like(b), b) for i, b in enumerate(start)}
        apply_delta(targets, changes, payload)
        assert all(torch.equal(bits(targets[i][0]), bits(t)) for i, t in enumerate(new))
    manifest, _ = delta_of(base, new)
    with pytest.raises(ManifestError, match="FULL"):  # without a base, only full tensors make sense
        DeltaManifest(**{**msgspec.structs.asdict(manifest), "base_version": None})
