"""HF <-> megatron-core names and layouts: round trips, the QKV interleave, views vs copies, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference import errors
from inference.models.dense.decoder import DenseDecoder
from tests.weight_sync.paged import random_hf_tensors, tiny_spec
from weight_sync.megatron.names import (
    FusedLayout,
    Naming,
    WeightNameError,
    WeightShapeError,
    detect_naming,
    fuse,
    hf_to_megatron,
    megatron_layout,
    megatron_to_hf,
    megatron_weight_shapes,
    split,
)

SPECS = {
    "gqa": {},
    "mqa": {"num_kv_heads": 1},
    "mha": {"num_kv_heads": 4},
    "tied": {"tie_word_embeddings": True},
    "qwen2": {"qkv_bias": True},
    "all_bias": {"qkv_bias": True, "o_bias": True, "mlp_bias": True},
    "qwen3": {"qk_norm": True, "num_heads": 6, "num_kv_heads": 3},
}


def brute_force_qkv(q, k, v, num_kv_heads, head_dim):
    """Megatron's row order built head by head: for each group, its q heads, its k head, its v head."""
    per_group = q.shape[0] // head_dim // num_kv_heads
    rows = []
    for g in range(num_kv_heads):
        for j in range(per_group):
            head = g * per_group + j
            rows.append(q[head * head_dim : (head + 1) * head_dim])
        rows.append(k[g * head_dim : (g + 1) * head_dim])
        rows.append(v[g * head_dim : (g + 1) * head_dim])
    return torch.cat(rows)


@pytest.mark.parametrize("variant", list(SPECS))
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trips_are_exact(variant, fused_norms):
    spec = tiny_spec(**SPECS[variant])
    hf = random_hf_tensors(spec)
    meg = hf_to_megatron(hf, spec, fused_norms=fused_norms)
    assert {n: tuple(t.shape) for n, t in meg.items()} == megatron_weight_shapes(spec, fused_norms=fused_norms)
    back = megatron_to_hf(meg, spec)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)
    again = hf_to_megatron(back, spec, fused_norms=fused_norms)
    assert all(torch.equal(again[n], meg[n]) for n in meg)
    assert ("output_layer.weight" in meg) != spec.tie_word_embeddings


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 6])
def test_qkv_interleave_matches_brute_force(num_kv_heads):
    spec = tiny_spec(num_heads=6, num_kv_heads=num_kv_heads, head_dim=4, qkv_bias=True)
    hf = random_hf_tensors(spec, seed=num_kv_heads)
    meg = hf_to_megatron(hf, spec)
    p = "model.layers.1.self_attn."
    for kind in ("weight", "bias"):
        q, k, v = (hf[f"{p}{x}_proj.{kind}"] for x in "qkv")
        expected = brute_force_qkv(q, k, v, num_kv_heads, 4)
        assert torch.equal(meg[f"decoder.layers.1.self_attention.linear_qkv.{kind}"], expected)


@settings(max_examples=40, deadline=None)
@given(
    groups=st.integers(1, 4),
    per_group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 4, 6]),
    hidden=st.integers(1, 5),
)
def test_qkv_split_is_a_view_exactly_with_one_group(groups, per_group, head_dim, hidden):
    spec = tiny_spec(num_heads=groups * per_group, num_kv_heads=groups, head_dim=head_dim, hidden_size=hidden)
    fused = torch.randn((groups * (per_group + 2) * head_dim, hidden))
    parts = split(fused, FusedLayout.QKV, spec)
    assert [p.shape[0] for p in parts] == [spec.q_size, spec.kv_size, spec.kv_size]
    assert torch.equal(fuse(parts, FusedLayout.QKV, spec), fused)
    shares = [p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for p in parts]
    assert shares == [groups == 1] * 3


def test_gate_up_halves_are_contiguous_views_that_see_in_place_updates():
    fc1 = torch.randn(2 * 112, 64)
    gate, up = split(fc1, FusedLayout.GATE_UP, tiny_spec())
    assert gate.is_contiguous() and up.is_contiguous()
    assert gate.data_ptr() == fc1.data_ptr() and up.data_ptr() == fc1.data_ptr() + 112 * 64 * fc1.element_size()
    fc1.add_(1.0)  # what an optimizer step does to megatron's parameter
    assert torch.equal(torch.cat((gate, up)), fc1)


def test_megatron_names_with_wrappers_and_extra_state():
    spec = tiny_spec()
    meg = hf_to_megatron(random_hf_tensors(spec), spec)
    wrapped = {"module.module." + n: t for n, t in meg.items()}
    wrapped["module.module.decoder.layers.0.mlp.linear_fc1._extra_state"] = None
    assert detect_naming(wrapped) is Naming.MEGATRON
    back = megatron_to_hf(wrapped, spec)
    assert back.keys() == spec.weight_shapes().keys()


def test_detect_naming():
    spec = tiny_spec()
    assert detect_naming(spec.weight_shapes()) is Naming.HF
    assert detect_naming(megatron_weight_shapes(spec)) is Naming.MEGATRON
    assert detect_naming(megatron_weight_shapes(spec, fused_norms=True)) is Naming.MEGATRON
    with pytest.raises(WeightNameError, match="mix"):
        detect_naming(["model.norm.weight", "decoder.final_layernorm.weight"])
    with pytest.raises(WeightNameError, match="transformer.h.0.attn"):
        detect_naming(["model.norm.weight", "transformer.h.0.attn.weight"])
    with pytest.raises(WeightNameError):
        detect_naming([])


def test_typed_errors_are_the_engines_classes():
    assert WeightNameError is errors.WeightNameError and issubclass(WeightNameError, KeyError)
    assert WeightShapeError is errors.WeightShapeError and issubclass(WeightShapeError, ValueError)


def _bad_updates(spec):
    meg = hf_to_megatron(random_hf_tensors(spec, seed=1), spec)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    yield WeightNameError, "unknown", {**meg, "decoder.layers.0.self_attention.bogus.weight": meg[qkv]}
    yield WeightNameError, "unknown", {**meg, "decoder.layers.2.mlp.linear_fc2.weight": meg[qkv]}  # layer 2 of 2
    yield WeightNameError, "unknown", {**meg, "decoder.layers.0.self_attention.linear_qkv.bias": meg[qkv][:, 0]}
    yield WeightNameError, "missing", {n: t for n, t in meg.items() if "linear_fc2" not in n}
    yield WeightNameError, "both hold", {**meg, "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": meg[qkv][0]}
    yield WeightShapeError, "wrong shapes", {**meg, qkv: meg[qkv][:-1]}
    yield WeightShapeError, "floating", {**meg, qkv: meg[qkv].long()}


@pytest.mark.parametrize("case", range(7))
def test_bad_updates_raise_typed_errors_and_change_nothing(case):
    spec = tiny_spec()
    error, message, update = list(_bad_updates(spec))[case]
    before = {n: t.clone() for n, t in update.items()}
    engine = DenseDecoder(spec, random_hf_tensors(spec))
    old = {n: t.clone() for n, t in engine.named_tensors().items()}
    with pytest.raises(error, match=message):
        engine.bind_weights(megatron_to_hf(update, spec), alias=False)
    assert all(torch.equal(update[n], before[n]) for n in update)
    assert all(torch.equal(t, old[n]) for n, t in engine.named_tensors().items())


def test_partial_updates():
    spec = tiny_spec()
    meg = hf_to_megatron(random_hf_tensors(spec), spec)
    bucket = {n: t for n, t in meg.items() if n.startswith("decoder.layers.1.")}
    hf = megatron_to_hf(bucket, spec, complete=False)
    assert set(hf) == {n for n in spec.weight_shapes() if n.startswith("model.layers.1.")}
    with pytest.raises(WeightNameError, match="missing"):
        megatron_to_hf(bucket, spec)
    q_only = {"model.layers.0.self_attn.q_proj.weight": hf["model.layers.1.self_attn.q_proj.weight"]}
    with pytest.raises(WeightNameError, match="fused"):
        hf_to_megatron(q_only, spec, complete=False)


def test_layout_lists_each_tensor_once():
    spec = tiny_spec(qk_norm=True, qkv_bias=True, tie_word_embeddings=True)
    for fused_norms in (False, True):
        layout = megatron_layout(spec, fused_norms=fused_norms)
        held = [h for t in layout.values() for h in t.hf_names]
        assert sorted(held) == sorted(spec.weight_shapes())
