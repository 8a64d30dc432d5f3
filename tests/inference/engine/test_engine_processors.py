"""The logit processors through the engine, greedy, against HF `generate` with the same processors
(repetition_penalty, min_new_tokens, bad_words_ids, sequence_bias, prefix_allowed_tokens_fn) and, for
OpenAI's presence / frequency penalties that HF lacks, a float64 greedy loop over the HF model.

All requests run in one engine batch with a plain greedy request beside them, so each slot's
parameters and counts must stay its own across steps; the plain one must be HF's plain greedy.
"""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, FinishReason, InferenceConfig, SamplingParams
from tests.inference.engine.conftest import VOCAB, hf_greedy, random_prompts, tiny_llama
from tests.reference import float64_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKENS = 10
EOS = 2


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=11)


@torch.no_grad()
def hf_generate(model, prompt: list[int], **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs.setdefault("eos_token_id", None)
    kwargs.setdefault("max_new_tokens", TOKENS)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def openai_penalised_greedy(reference, prompt: list[int], presence: float, frequency: float) -> list[int]:
    """Greedy over float64 logits minus presence * (count > 0) + frequency * count of the output."""
    ids, counts = list(prompt), torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(TOKENS):
        logits = reference(torch.tensor([ids])).logits[0, -1]
        tok = int((logits - frequency * counts - presence * (counts > 0).double()).argmax())
        counts[tok] += 1
        ids.append(tok)
    return ids[len(prompt):]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=kw.pop("ignore_eos", True), **kw)


def test_each_processor_matches_hf_generate_in_one_batch(model):
    prompts = random_prompts(8, 4, 9, seed=5)
    plain = [hf_greedy(model, p, TOKENS) for p in prompts]
    g = plain[2]
    bad = [[g[0]], [g[2], g[3]]]  # the first greedy token, and the fourth after the third
    assert prompts[2][-1] != g[2], "the prompt's tail would match the bad word in HF (it matches over the prompt)"
    allowed = sorted(set(plain[3][1::2]) | {7, 8, 9})
    cases = [
        (greedy(), {}),
        (greedy(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (greedy(bad_words_token_ids=bad), dict(bad_words_ids=bad)),
        (greedy(allowed_token_ids=allowed), dict(prefix_allowed_tokens_fn=lambda batch, ids: allowed)),
        (greedy(logit_bias={g[1]: -4.0, 50: 3.0}), dict(sequence_bias={(g[1],): -4.0, (50,): 3.0})),
        # EOS biased up so the model wants it early; min_tokens holds it off for 6 tokens
        (greedy(logit_bias={EOS: 30.0}, min_tokens=6, ignore_eos=False),
         dict(sequence_bias={(EOS,): 30.0}, min_new_tokens=6, eos_token_id=EOS)),
        (greedy(repetition_penalty=0.6, logit_bias={40: 1.5}),
         dict(repetition_penalty=0.6, sequence_bias={(40,): 1.5})),
    ]
    engine = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(
        block_size=4, num_blocks=256, max_requests=16, max_batch_tokens=128, max_sequence_length=64))
    reference = float64_copy(model)
    penalised = [(0.8, 0.0), (0.0, 1.2), (1.5, -0.5)]
    params = [c[0] for c in cases] + [greedy(presence_penalty=pr, frequency_penalty=fr) for pr, fr in penalised]
    outs = engine.generate(prompts[: len(cases)] + prompts[: len(penalised)], params)
    for i, (out, (_, hf_kwargs)) in enumerate(zip(outs, cases)):
        want = hf_generate(model, prompts[i], **hf_kwargs)
        assert out.generated_token_ids == want, (i, hf_kwargs)
    assert outs[0].generated_token_ids == plain[0]
    assert outs[1].generated_token_ids != plain[1] and outs[2].generated_token_ids != plain[2]
    assert set(outs[3].generated_token_ids) <= set(allowed)
    eos_out = outs[5]
    assert eos_out.generated_token_ids == [*eos_out.generated_token_ids[:6], EOS]
    assert eos_out.finish_reason is FinishReason.STOP and EOS not in eos_out.generated_token_ids[:6]
    for out, prompt, (pr, fr) in zip(outs[len(cases):], prompts, penalised):
        assert out.generated_token_ids == openai_penalised_greedy(reference, prompt, pr, fr), (pr, fr)


def test_penalty_counts_survive_preemption(model):
    """A penalised request evicted mid-decode and recomputed keeps its counts (bound again from its
    tokens) and matches HF, beside requests that fill the pool."""
    prompts = random_prompts(4, 6, 8, seed=9)
    engine = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(
        block_size=4, num_blocks=14, max_requests=4, max_batch_tokens=64, max_sequence_length=64))
    outs = engine.generate(prompts, greedy(repetition_penalty=1.5))
    assert sum(o.num_preemptions for o in outs) > 0, "the pool must be small enough to preempt"
    for out, prompt in zip(outs, prompts):
        assert out.generated_token_ids == hf_generate(model, prompt, repetition_penalty=1.5)


def test_token_ids_outside_the_vocabulary_are_refused(model):
    engine = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(
        block_size=4, num_blocks=32, max_requests=2, max_batch_tokens=32, max_sequence_length=32))
    for kw, name in [(dict(logit_bias={VOCAB: 1.0}), "logit_bias"), (dict(allowed_token_ids=[1, VOCAB]),
                                                                     "allowed_token_ids"),
                     (dict(bad_words_token_ids=[[3, VOCAB + 5]]), "bad_words_token_ids")]:
        with pytest.raises(ValueError, match=f"^{name}: token"):
            engine.generate([[5, 6]], greedy(**kw))
