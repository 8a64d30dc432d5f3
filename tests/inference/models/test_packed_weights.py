"""bf16 weights packed once for oneDNN (`packed_weights.py`): the same bits as `F.linear`, and never stale.

The engine-level tests run on every CPU (where oneDNN takes no bf16 products the layers keep
`F.linear`); they fail if a pack outlived its weight through an update, a colocated trainer's
in-place step or a suspend.
"""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams, Staging
from inference.models import packed_weights
from tests.inference.engine.conftest import random_prompts, tiny_llama

needs_onednn_bf16 = pytest.mark.skipif(not packed_weights.supported(), reason="oneDNN takes no bf16 products here")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts(5, 4, 20, seed=61)


def bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 33, 64, 129, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_product_is_f_linears_bits(rows, with_bias):
    weight, x = bf16(200, 96, seed=1), bf16(rows, 96, seed=2)
    bias = bf16(200, seed=3) if with_bias else None
    assert packed_weights.packable(x, weight, bias)
    assert torch.equal(packed_weights.linear(x, weight, bias), F.linear(x, weight, bias))
    # a row's bits do not depend on the rows beside it
    assert torch.equal(packed_weights.linear(x[-1:], weight, bias)[0], F.linear(x, weight, bias)[-1])


@needs_onednn_bf16
def test_inputs_of_three_dims_and_strided_rows_keep_f_linears_bits():
    weight = bf16(64, 48, seed=4)
    x3 = bf16(3, 5, 48, seed=5)
    strided = bf16(9, 100, seed=6)[:, 10:58]
    assert torch.equal(packed_weights.linear(x3, weight), F.linear(x3, weight))
    assert torch.equal(packed_weights.linear(strided, weight), F.linear(strided, weight))


@needs_onednn_bf16
def test_a_weight_written_in_place_or_moved_is_packed_again():
    weight, x = bf16(40, 32, seed=7), bf16(4, 32, seed=8)
    packed_weights.linear(x, weight)
    weight.copy_(bf16(40, 32, seed=9))  # an update's copy, a trainer's step on an aliased tensor
    assert torch.equal(packed_weights.linear(x, weight), F.linear(x, weight))
    weight.data = bf16(40, 32, seed=10)  # new storage, no in-place write
    assert torch.equal(packed_weights.linear(x, weight), F.linear(x, weight))


@needs_onednn_bf16
def test_packs_go_with_their_weights_and_forget_all_drops_them():
    packed_weights.forget_all()
    weight, x = bf16(128, 64, seed=11), bf16(2, 64, seed=12)
    packed_weights.linear(x, weight)
    assert packed_weights.packed_bytes() == weight.numel() * 2
    del weight
    gc.collect()
    assert packed_weights.packed_bytes() == 0 and not packed_weights._packs
    other = bf16(128, 64, seed=13)
    packed_weights.linear(x, other)
    packed_weights.forget_all()
    assert not packed_weights._packs


def test_fp32_and_grad_taking_products_are_not_packed():
    weight = bf16(8, 8, seed=14)
    assert not packed_weights.packable(torch.randn(2, 8), weight.float())
    trained = weight.clone().requires_grad_()
    assert not packed_weights.packable(bf16(2, 8, seed=15), trained)
    with torch.no_grad():
        assert packed_weights.packable(bf16(2, 8, seed=15), trained) == packed_weights.supported()


# ---- the engine in bf16: every way its weights change is seen -------------------------------------


def config() -> InferenceConfig:
    return InferenceConfig(block_size=4, num_blocks=128, max_requests=8, max_batch_tokens=64, max_sequence_length=64)


def outputs(engine) -> list[list[int]]:
    return [o.generated_token_ids for o in engine.generate(PROMPTS, GREEDY)]


def bf16_llama(seed: int):
    return tiny_llama(seed=seed).to(torch.bfloat16)


@pytest.fixture(scope="module")
def new_model():
    return bf16_llama(seed=32)


@pytest.fixture(scope="module")
def fresh_new(new_model):
    engine = DynamicInferenceEngine.from_pretrained(new_model, config())
    assert engine.model.spec.dtype == torch.bfloat16
    return outputs(engine)


def test_a_copied_update_in_bf16_equals_a_fresh_engine(new_model, fresh_new):
    engine = DynamicInferenceEngine.from_pretrained(bf16_llama(seed=31), config())
    before = outputs(engine)
    engine.update_weights(new_model.named_parameters())
    assert outputs(engine) == fresh_new != before


@pytest.mark.parametrize("staging", list(Staging))
def test_a_staged_update_in_bf16_equals_a_fresh_engine(new_model, fresh_new, staging):
    engine = DynamicInferenceEngine.from_pretrained(bf16_llama(seed=31), config())
    before = outputs(engine)  # NOTE: once: a repeat hits the prefix cache, whose bf16 prefill rounds otherwise
    for _ in range(2):  # NOTE: the second round writes into the buffers the first one retired
        engine.begin_update(staging=staging, retain_staging=True)
        engine.load_weights(dict(new_model.named_parameters()))
        engine.commit_update()
        assert outputs(engine) == fresh_new
        engine.update_weights(bf16_llama(seed=31).named_parameters())
        assert outputs(engine) == before


def test_a_colocated_trainers_step_in_bf16_is_seen_after_the_sync():
    trainer = bf16_llama(seed=33)
    engine = DynamicInferenceEngine.from_pretrained(trainer, config(), share_weights=True)
    before = outputs(engine)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    engine.on_weights_updated()
    fresh = DynamicInferenceEngine.from_pretrained(copy.deepcopy(trainer), config())
    assert outputs(engine) == outputs(fresh) != before


def test_a_suspend_that_offloads_bf16_weights_frees_their_packs():
    engine = DynamicInferenceEngine.from_pretrained(bf16_llama(seed=34), config())
    before = outputs(engine)
    engine.suspend(offload_weights=True)
    assert packed_weights.packed_bytes() == 0
    engine.resume()
    assert outputs(engine) == before


# ---- weights side by side (q, k, v; gate, up) ----------------------------------------------------


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 8, 33, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weights_side_by_side_give_each_f_linears_bits(rows, with_bias):
    weights = (bf16(96, 64, seed=20), bf16(32, 64, seed=21), bf16(32, 64, seed=22))
    biases = tuple(bf16(w.shape[0], seed=23 + i) for i, w in enumerate(weights)) if with_bias else (None,) * 3
    x = bf16(rows, 64, seed=26)
    out = packed_weights.linear_group(x, weights, biases)
    for part, w, b in zip(out.split([w.shape[0] for w in weights], dim=-1), weights, biases):
        assert torch.equal(part, F.linear(x, w, b))


@needs_onednn_bf16
def test_a_group_is_packed_again_when_one_member_is_written():
    weights, x = (bf16(16, 8, seed=30), bf16(24, 8, seed=31)), bf16(3, 8, seed=32)
    packed_weights.linear_group(x, weights, (None, None))
    weights[1].copy_(bf16(24, 8, seed=33))
    assert torch.equal(packed_weights.linear_group(x, weights, (None, None))[:, 16:], F.linear(x, weights[1]))


def test_a_group_with_some_biases_or_fp32_weights_is_left_to_the_caller():
    x, w = bf16(2, 8, seed=34), bf16(4, 8, seed=35)
    assert packed_weights.linear_group(x, (w, w.clone()), (bf16(4, seed=36), None)) is None
    assert packed_weights.linear_group(x.float(), (w.float(), w.float()), (None, None)) is None


def test_a_hybrid_model_in_bf16_gives_the_same_tokens_with_packs_and_without(monkeypatch):
    from tests.inference.models.hybrid.tiny import tiny_hybrid

    model = tiny_hybrid("bamba", seed=7).to(torch.bfloat16)
    cfg = InferenceConfig(block_size=4, num_blocks=256, max_requests=16, max_batch_tokens=64, chunked_prefill_size=8,
                          max_sequence_length=64)
    prompts = random_prompts(6, 3, 26, seed=17)
    packed_weights.forget_all()
    run = lambda: [o.generated_token_ids  # noqa: E731
                   for o in DynamicInferenceEngine.from_pretrained(model, cfg).generate(prompts, GREEDY)]
    packed = run()
    assert bool(packed_weights._packs) == packed_weights.supported()  # NOTE: the Mamba and attention projections
    monkeypatch.setattr(packed_weights, "supported", lambda: False)
    assert packed == run()


def test_a_weight_dying_while_the_packs_are_locked_does_not_deadlock():
    """A transient weight (a view made per call, as a LoRA B^T turned back) freed by the cyclic collector
    that an allocation under the packs' lock runs: its `drop` runs on the thread holding the lock. Run in a
    process of its own, so that a deadlock fails the test instead of hanging it."""
    script = (
        "import gc, torch\n"
        "from inference.models import packed_weights as pw\n"
        "w = torch.randn(32, 16, dtype=torch.bfloat16)\n"
        "class Cycle: pass\n"
        "def make():\n"
        "    v = w.t().t()\n"
        "    c = Cycle(); c.self = c; c.v = v  # freed only by the cyclic collector\n"
        "    pw.cached_pack((v,), (), lambda t: t.clone())\n"
        "for i in range(2000):\n"
        "    make()\n"
        "    if i % 500 == 0: gc.collect()\n"
        "print('done')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]
