"""Manifests and buckets without an engine: layouts, packing, checksums, validation, versions,
payloads, and the tensor-parallel merge on a synthetic shard layout."""

from __future__ import annotations

import base64
import pickle

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from inference.errors import WeightNameError, WeightShapeError
from tests.weight_sync.paged import random_hf_tensors, tiny_spec
from weight_sync.buckets import (
    bucket_checksum,
    fill_checksums,
    manifest_for,
    pack_bucket,
    tensor_checksum,
    unpack_bucket,
)
from weight_sync.manifest import (
    ALIGN,
    Manifest,
    ManifestError,
    check_against_model,
    decode_manifest,
    encode_manifest,
    parse_weight_version,
)
from weight_sync.megatron.names import hf_to_megatron
from weight_sync.megatron.tp_gather import merge_shards
from weight_sync.sources import SharedMemorySource, decode_tensor_payload, encode_tensor_payload

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

tensor_specs = st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 9), min_size=0, max_size=3)),
                        min_size=1, max_size=12)


def make(specs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}", torch.randn(shape, generator=gen).to(dtype)) for i, (dtype, shape) in enumerate(specs)]


@settings(max_examples=60, deadline=None)
@given(specs=tensor_specs, bucket_bytes=st.integers(ALIGN, 1024))
def test_packing_round_trips_and_both_checksums_agree(specs, bucket_bytes):
    named = make(specs)
    tensors = [t for _, t in named]
    manifest = manifest_for(named, bucket_bytes=bucket_bytes, version=3)
    assert decode_manifest(encode_manifest(manifest)) == manifest  # the layout passes its own checks
    precomputed = manifest_for(named, bucket_bytes=bucket_bytes)
    fill_checksums(precomputed, tensors)
    sizes = manifest.tensor_bytes()
    for index, bucket in enumerate(manifest.layout.buckets):
        end = manifest.layout.offsets[bucket.stop - 1] + sizes[bucket.stop - 1]
        assert end <= bucket_bytes or bucket.stop - bucket.start == 1  # full, or one tensor larger than a bucket
        assert bucket.nbytes == -(-end // ALIGN) * ALIGN
        buf = torch.full((bucket.nbytes + 128,), 0xAB, dtype=torch.uint8)  # stale bytes where gaps go
        checksum = pack_bucket(manifest, index, tensors, buf)
        assert checksum == precomputed.layout.buckets[index].checksum == bucket_checksum(buf, bucket)
        for name, view in unpack_bucket(manifest, index, buf).items():
            assert torch.equal(view, dict(named)[name])


@settings(max_examples=60, deadline=None)
@given(specs=tensor_specs, data=st.data())
def test_a_flipped_byte_changes_the_checksum(specs, data):
    named = make(specs)
    manifest = manifest_for(named, bucket_bytes=256)
    index = data.draw(st.integers(0, len(manifest.layout.buckets) - 1))
    bucket = manifest.layout.buckets[index]
    assume(bucket.nbytes > 0)
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    checksum = pack_bucket(manifest, index, [t for _, t in named], buf)
    position = data.draw(st.integers(0, bucket.nbytes - 1))
    buf[position] ^= data.draw(st.integers(1, 255))
    assert bucket_checksum(buf, bucket) != checksum


def test_a_tensor_larger_than_a_bucket_gets_one_of_its_own_and_gaps_are_aligned():
    named = [("a", torch.ones(3)), ("b", torch.ones(100)), ("c", torch.ones(5, dtype=torch.bfloat16)),
             ("d", torch.ones(2))]
    layout = manifest_for(named, bucket_bytes=128).layout
    assert [(b.start, b.stop) for b in layout.buckets] == [(0, 1), (1, 2), (2, 4)]
    assert layout.offsets == [0, 0, 0, 64] and [b.nbytes for b in layout.buckets] == [64, 448, 128]
    assert layout.region_offsets() == [0, 64, 512]
    assert tensor_checksum(torch.ones(3)) == tensor_checksum(torch.ones(3).view(torch.uint8).view(torch.float32))


@pytest.mark.parametrize("change, match", [
    (dict(dtypes=["float32"]), "names"),
    (dict(names=["a", "a"]), "twice"),
    (dict(dtypes=["float32", "int8"]), "dtypes"),
    (dict(total_bytes=5), "total_bytes"),
])
def test_a_manifest_that_contradicts_itself_is_refused(change, match):
    fields = dict(names=["a", "b"], dtypes=["float32", "bfloat16"], shapes=[[2], [3]])
    with pytest.raises(ManifestError, match=match):
        Manifest(**{**fields, **change})


def test_a_layout_that_does_not_fit_is_refused():
    good = manifest_for([("a", torch.ones(4)), ("b", torch.ones(4))], bucket_bytes=64)
    raw = encode_manifest(good).replace(b"\xa1a", b"\xa1a")  # same bytes, decodes
    assert decode_manifest(raw) == good
    for mutate, match in [(lambda m: m.layout.offsets.__setitem__(0, 8), "aligned"),
                          (lambda m: m.layout.buckets.pop(), "cover"),
                          (lambda m: setattr(m.layout.buckets[0], "nbytes", 8), "multiple")]:
        bad = decode_manifest(encode_manifest(good))
        mutate(bad)
        with pytest.raises(ManifestError, match=match):
            decode_manifest(encode_manifest(bad))
    assert good.layout is not None and encode_manifest(good) == encode_manifest(decode_manifest(encode_manifest(good)))


def test_the_model_check_refuses_another_model_by_name_shape_or_completeness():
    spec = tiny_spec()
    hf = random_hf_tensors(spec)
    assert check_against_model(manifest_for(list(hf.items())), spec).value == "hf"
    megatron = hf_to_megatron(hf, spec)
    assert check_against_model(manifest_for(list(megatron.items())), spec).value == "megatron"
    wider = random_hf_tensors(tiny_spec(hidden_size=96, head_dim=24))
    with pytest.raises(WeightShapeError, match="another model"):
        check_against_model(manifest_for(list(wider.items())), spec)
    deeper = random_hf_tensors(tiny_spec(num_layers=3))
    with pytest.raises(WeightNameError, match="another model"):
        check_against_model(manifest_for(list(deeper.items())), spec)
    some = list(hf.items())[:3]
    with pytest.raises(WeightNameError, match="lacks"):
        check_against_model(manifest_for(some), spec)
    assert check_against_model(manifest_for(some), spec, complete=False).value == "hf"


@pytest.mark.parametrize("value, version", [(None, None), (7, 7), ("7", 7), ("v12", 12), ("step_3", 3),
                                            (" 4 ", 4)])
def test_weight_versions_map_to_integers(value, version):
    assert parse_weight_version(value) == version


@pytest.mark.parametrize("value", ["latest", "1.5", "-3", -1, True, "7a", ""])
def test_weight_versions_that_name_no_integer_are_refused(value):
    with pytest.raises(ManifestError, match="weight_version"):
        parse_weight_version(value)


def test_tensor_payloads_are_msgpack_and_pickle_is_refused():
    manifest = manifest_for([("a", torch.ones(2))])
    source = SharedMemorySource(manifest=manifest, segment="rollout-wsync-1-0123456789abcdef", token=2**63 - 1)
    data = encode_tensor_payload(source)
    assert decode_tensor_payload(data) == source
    assert decode_tensor_payload(base64.b64encode(data).decode()) == source  # as SGLang's HTTP clients send it
    with pytest.raises(ManifestError, match="pickled payload .* refused"):
        decode_tensor_payload(pickle.dumps([("a", torch.ones(2))]))
    with pytest.raises(ManifestError, match="not a shared-memory handle"):
        decode_tensor_payload(b"\x92\x01\x02")
    with pytest.raises(ValueError, match="not one of ours"):
        SharedMemorySource(manifest=manifest, segment="../../dev/mem")


def test_tensor_parallel_shards_merge_into_the_whole_tensors():
    """Megatron's layouts, made by hand: column-parallel rows, row-parallel columns, and a gated
    MLP's fc1 whose rank i holds [gate_i; up_i]."""
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
    fused = torch.cat([gate, up])
    tp = 2
    fc1_shards = [torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]) for r in range(tp)]
    assert torch.equal(merge_shards("decoder.layers.0.mlp.linear_fc1.weight", fc1_shards, 0, glu=True), fused)
    qkv = torch.randn(12, 4, generator=gen)
    assert torch.equal(merge_shards("decoder.layers.0.self_attention.linear_qkv.weight", list(qkv.chunk(tp)), 0,
                                    glu=True), qkv)
    proj = torch.randn(4, 6, generator=gen)
    assert torch.equal(merge_shards("decoder.layers.0.self_attention.linear_proj.weight",
                                    list(proj.chunk(tp, dim=1)), 1, glu=True), proj)
    norm = torch.randn(4, generator=gen)
    assert merge_shards("decoder.final_layernorm.weight", [norm, norm], -1, glu=True) is norm
