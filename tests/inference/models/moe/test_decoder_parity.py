"""MoE decoders through the engine against HF transformers (fp32): Qwen3-MoE, Qwen2-MoE (shared
expert), Mixtral. Greedy tokens equal HF `generate`'s and log-probs are within 5e-6 of an HF forward in float64,
with chunked prefill and with a pool so small that requests are preempted; plus the router and the
expert dispatch on their own, and loading from disk (per-expert names) or a live module."""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.models.loading import load_from_hf_dir, read_safetensors
from inference.models.moe.decoder import MoeDecoder
from inference.models.moe.dispatch import LocalDispatch
from inference.models.moe.layer import ExpertWeights, RouterSpec, Scoring, route, weights_for
from inference.models.moe.names import localize_expert_tensors
from tests.inference.engine.conftest import hf_greedy, random_prompts
from tests.inference.models.moe.tiny import FAMILIES, tiny_moe
from tests.reference import float64_copy, max_logprob_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# NOTE: |log p| < 8 (384 tokens, logits < 1): a few fp32 roundings of half an ulp (4.8e-7) there.
# Measured max |engine - float64 HF| 5.7e-7 over the families and the CPU settings CI simulates: 9x.
TOLERANCE = 5e-6


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=256, max_requests=8, max_batch_tokens=32, chunked_prefill_size=8,
                  max_sequence_length=48)
    fields.update(overrides)
    return InferenceConfig(**fields)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    """(family, HF model, prompts, HF greedy continuations)."""
    hf = tiny_moe(request.param, seed=4)
    prompts = random_prompts(12, 3, 30, seed=7)
    return request.param, hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def max_logprob_diff(hf, outputs) -> float:
    """Largest |engine - HF| log-prob over every generated token (HF in float64: one forward per sequence)."""
    return max_logprob_error(float64_copy(hf), outputs)


def test_chunked_prefill_matches_hf(case):
    family, hf, prompts, expected = case
    engine = DynamicInferenceEngine.from_pretrained(hf, config())
    assert isinstance(engine.model, MoeDecoder) and engine.model.spec.moe_family.value == family
    outputs = engine.generate(prompts, GREEDY)
    assert [o.generated_token_ids for o in outputs] == expected
    assert max_logprob_diff(hf, outputs) < TOLERANCE
    assert engine.stats()["prefill_tokens"] == sum(len(p) for p in prompts)


def test_preemption_and_a_loaded_directory_match_hf(case, tmp_path):
    family, hf, prompts, expected = case
    hf.save_pretrained(tmp_path)  # per-expert names on disk (Mixtral: block_sparse_moe.experts.{e}.w1/w2/w3)
    engine = DynamicInferenceEngine.from_pretrained(tmp_path, config(num_blocks=24, paused_block_budget=8))
    outputs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.generated_token_ids for o in outputs] == expected
    assert max_logprob_diff(hf, outputs) < TOLERANCE
    assert engine.allocator.active == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_matches_hf_router(family):
    hf = tiny_moe(family, seed=1)
    gate = hf.model.layers[0].mlp.gate
    h = torch.randn(37, 64)
    _, hf_weights, hf_ids = gate(h)
    spec = RouterSpec(8, 2, normalize=True, fp32_weights=family == "mixtral")
    ids, weights = route(h, gate.weight.detach(), spec)
    # the router in float64: softmax over all experts, the top 2, renormalised
    top = torch.softmax(h.double() @ gate.weight.detach().double().T, -1).topk(2, dim=-1)
    assert torch.equal(ids, top.indices) and torch.equal(hf_ids, top.indices)
    assert weights.dtype == hf_weights.dtype
    for got in (weights, hf_weights.detach()):  # ours and HF's, each against float64
        # NOTE: fp32 rounds the 64-term logits (|logit| < 8) by ~sqrt(64) x 6e-8 x 12 = 6e-6 at most
        # typically; a weight moves by < 2 p (1 - p) times that. Measured max 4e-7, 10x under.
        torch.testing.assert_close(got.double(), top.values / top.values.sum(-1, keepdim=True), atol=4e-6, rtol=0)


def test_sigmoid_scoring_and_replayed_choices():
    torch.manual_seed(0)
    h, w = torch.randn(9, 16), torch.randn(6, 16)
    spec = RouterSpec(6, 3, Scoring.SIGMOID, normalize=True)
    ids, weights = route(h, w, spec)
    scores = torch.sigmoid(h.double() @ w.double().T)  # float64
    top = scores.topk(3, dim=-1)
    assert torch.equal(ids, top.indices)
    # NOTE: weights in (0, 1) from 16-term logits and a sigmoid: a few fp32 ulps, ~5e-7; measured 5e-8
    torch.testing.assert_close(weights.double(), top.values / top.values.sum(-1, keepdim=True), atol=1e-6, rtol=0)
    forced = torch.tensor([[5, 0, 1]] * 9)  # a replayed choice: its weights from the same scores
    given = scores.float()  # fp32 scores in, as the router hands them; the reference is exact on them
    want = given.double().gather(1, forced) / given.double().gather(1, forced).sum(-1, keepdim=True)
    # NOTE: a 3-term sum and a division: 2 fp32 roundings of weights < 1, < 1.2e-7
    torch.testing.assert_close(weights_for(given, forced, spec, torch.float32).double(), want, atol=2.4e-7, rtol=0)


def test_static_and_variable_dispatch_agree():
    hf = tiny_moe("qwen3_moe", seed=2)
    decoder = DynamicInferenceEngine.from_pretrained(hf, config()).model
    _, layer = decoder._moe[0]
    h = torch.randn(11, 64)
    ids, _ = route(h, layer.router_w, decoder.spec.router)
    dispatch = LocalDispatch(8)
    # each (token, choice) pair through its expert in float64
    experts64 = ExpertWeights(layer.experts.gate_up.double(), layer.experts.down.double())
    k = ids.shape[1]
    want = torch.cat([experts64.expert(int(e), h[i // k, None].double()) for i, e in enumerate(ids.reshape(-1))])
    for static in (False, True):  # the two paths multiply different shapes, so they round differently
        # NOTE: |out| < 0.01 through a 64- and a 32-term product: a few fp32 ulps (6e-10 there) and the
        # error carried from the larger intermediate; measured max 3e-9 on either path, 1e-7 is 30x
        torch.testing.assert_close(dispatch.run(h, ids, layer.experts, static=static).double(), want,
                                   atol=1e-7, rtol=0)


def test_an_expert_parallel_rank_takes_only_its_experts(tmp_path):
    hf = tiny_moe("qwen3_moe", seed=3)
    hf.save_pretrained(tmp_path)
    full = load_from_hf_dir(tmp_path)
    spec = full.spec.with_expert_parallel(4, 2)
    fused = dict(hf.named_parameters())
    name = "model.layers.1.mlp.experts.gate_up_proj"
    local = localize_expert_tensors(spec, fused)
    assert local[name].shape[0] == 2 and local[name].data_ptr() == fused[name][4].data_ptr()  # a view
    per_expert = read_safetensors(tmp_path, None)  # names one expert at a time
    assert torch.equal(localize_expert_tensors(spec, per_expert)[name], fused[name][4:6])
    assert full.expert_bytes() == sum(fused[n].nbytes for n in spec.expert_names())
