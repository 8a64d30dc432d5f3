"""The logit processors against transformers' own (RepetitionPenalty, MinNewTokensLength, NoBadWords,
SequenceBias), OpenAI's presence / frequency formula in float64 and an allowed-ids mask, on fixed random
logits and a few steps of generated history; then through the sampler (greedy choices, log-probs)."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from inference.sampling import native
from inference.sampling.batch import SamplingBatch
from inference.sampling.params import LogprobsMode, SamplingParams
from inference.sampling.processor_state import ProcessorState
from inference.sampling.processors import apply_processors
from inference.sampling.sampler import sample

VOCAB = 64
EOS = 2
ROWS = 6


def history(seed: int, rows: int = ROWS) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) per row; tokens from a narrow range so that they repeat."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 20, size=rng.integers(2, 7)).tolist(),
             rng.integers(3, 20, size=rng.integers(3, 9)).tolist()) for _ in range(rows)]


def processors_of(params: list[SamplingParams], hist, *, incremental: bool = True, eos=(EOS,)):
    """Bind each row (slot = row) and feed its output token by token (`incremental`) or at bind;
    returns the step's processors and the state with its token arrays."""
    state = ProcessorState(len(params), VOCAB, eos)
    length = max(len(p) + len(o) for p, o in hist) + 1
    tokens = np.zeros((len(params), length), dtype=np.int64)
    prompt_len = np.array([len(p) for p, _ in hist], dtype=np.int64)
    seq_len = prompt_len.copy()
    for slot, (p, (prompt, output)) in enumerate(zip(params, hist)):
        tokens[slot, : len(prompt)] = prompt
        if not incremental:
            tokens[slot, len(prompt): len(prompt) + len(output)] = output
            seq_len[slot] += len(output)
        state.bind(slot, p, tokens[slot, : len(prompt)], tokens[slot, len(prompt): seq_len[slot]])
    if incremental:
        for step in range(max(len(o) for _, o in hist)):
            slots = np.array([s for s, (_, o) in enumerate(hist) if len(o) > step], dtype=np.int64)
            new = np.array([hist[s][1][step] for s in slots], dtype=np.int64)
            tokens[slots, seq_len[slots]] = new
            seq_len[slots] += 1
            state.append(slots, new)
    return state.for_rows(np.arange(len(params)), tokens, seq_len, prompt_len), state


def logits_of(seed: int, rows: int = ROWS) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def processed(x: torch.Tensor, params, hist, **kw) -> torch.Tensor:
    procs, _ = processors_of(params, hist, **kw)
    return apply_processors(x.clone(), procs)


def hf_row(processor, input_ids: list[int], x_row: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([input_ids]), x_row[None].clone())[0]


@pytest.mark.parametrize("incremental", [True, False])
def test_repetition_penalty_matches_transformers(incremental):
    hist, x = history(0), logits_of(0)
    penalties = [0.5, 1.3, 2.0, 1.0, 0.9, 3.0]
    ours = processed(x, [SamplingParams(repetition_penalty=r) for r in penalties], hist, incremental=incremental)
    for row, ((prompt, output), r) in enumerate(zip(hist, penalties)):
        ref = hf_row(RepetitionPenaltyLogitsProcessor(r), prompt + output, x[row])
        assert torch.allclose(ours[row], ref, rtol=1e-6, atol=0), row
    assert not torch.equal(ours[0], x[0])  # the test can see a penalty


@pytest.mark.parametrize("incremental", [True, False])
def test_presence_and_frequency_follow_openais_formula_over_the_output(incremental):
    hist, x = history(1), logits_of(1)
    pairs = [(0.5, 0.0), (0.0, 0.7), (-2.0, 2.0), (2.0, -1.5), (1.0, 1.0), (0.0, -0.25)]
    params = [SamplingParams(presence_penalty=pr, frequency_penalty=fr) for pr, fr in pairs]
    ours = processed(x, params, hist, incremental=incremental)
    for row, ((_, output), (pr, fr)) in enumerate(zip(hist, pairs)):
        counts = torch.bincount(torch.tensor(output), minlength=VOCAB).double()  # the prompt is not counted
        ref = x[row].double() - fr * counts - pr * (counts > 0).double()
        assert torch.allclose(ours[row].double(), ref, rtol=0, atol=1e-5), row


def test_min_tokens_matches_transformers_min_new_tokens():
    hist, x = history(2), logits_of(2)
    stops = [[], [5], [7, 9], [], [11], []]
    mins = [len(o) + 1 for _, o in hist[:3]] + [len(hist[3][1]), 1, len(hist[5][1]) + 4]  # under: rows 0-2, 5
    params = [SamplingParams(min_tokens=m, max_tokens=32, stop_token_ids=s) for m, s in zip(mins, stops)]
    ours = processed(x, params, hist)
    for row, ((prompt, output), m, s) in enumerate(zip(hist, mins, stops)):
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), m, [EOS, *s])
        assert torch.equal(ours[row], hf_row(hf, prompt + output, x[row])), row
    assert ours[0, EOS] == -math.inf and ours[3, EOS] == x[3, EOS]
    ignoring = processed(x[:1], [SamplingParams(min_tokens=30, max_tokens=32, ignore_eos=True, stop_token_ids=[4])],
                         hist[:1])
    assert ignoring[0, EOS] == x[0, EOS] and ignoring[0, 4] == -math.inf  # vLLM: EOS is no stop then


def test_bad_words_match_transformers_over_the_output():
    hist, x = history(3), logits_of(3)
    words = []
    for _, output in hist:  # each row: a word ending its output (hit), a one-token word, a near miss
        words.append([output[-2:] + [40], [41], [output[-1] + 1, 42], output[-3:] + [43]])
    ours = processed(x, [SamplingParams(bad_words_token_ids=w) for w in words], hist)
    for row, ((_, output), w) in enumerate(zip(hist, words)):
        ref = hf_row(NoBadWordsLogitsProcessor(w), output, x[row])  # vLLM matches the output only
        assert torch.equal(ours[row], ref), row
        assert ours[row, 40] == ours[row, 41] == ours[row, 43] == -math.inf and ours[row, 42] == x[row, 42]


def test_a_bad_word_longer_than_the_output_is_not_matched_into_the_prompt():
    x = logits_of(4, rows=2)
    hist = [([7, 8], [9]), ([7, 8], [])]
    ours = processed(x, [SamplingParams(bad_words_token_ids=[[8, 9, 30], [9, 31], [32]])] * 2, hist)
    assert ours[0, 30] == x[0, 30] and ours[0, 31] == -math.inf and ours[0, 32] == -math.inf
    assert ours[1, 31] == x[1, 31] and ours[1, 32] == -math.inf


def test_logit_bias_matches_transformers_sequence_bias():
    hist, x = history(5), logits_of(5)
    biases = [{3: 100.0, 9: -100.0}, {0: 0.5}, {63: -2.5, 1: 7.0, 20: -0.125}, {}, {5: 1.0}, {6: -1.0}]
    ours = processed(x, [SamplingParams(logit_bias=b) for b in biases], hist)
    for row, ((prompt, output), b) in enumerate(zip(hist, biases)):
        if not b:
            assert torch.equal(ours[row], x[row])
            continue
        hf = SequenceBiasLogitsProcessor([[[tok], bias] for tok, bias in b.items()])
        assert torch.allclose(ours[row], hf_row(hf, prompt + output, x[row]), rtol=1e-6, atol=0), row


def test_allowed_token_ids_mask_every_other_token():
    hist, x = history(6), logits_of(6)
    allowed = [[1, 5, 9], [63], [0, 0, 2], [10, 11], [3], [60, 4]]
    ours = processed(x, [SamplingParams(allowed_token_ids=a) for a in allowed], hist)
    for row, a in enumerate(allowed):
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[a] = True
        assert torch.equal(ours[row], torch.where(keep, x[row], -math.inf)), row


def hf_pipeline(p: SamplingParams, prompt: list[int], output: list[int], x_row: torch.Tensor) -> torch.Tensor:
    """vLLM's order with transformers' processors: bias, allowed, bad words, min tokens, penalties."""
    z = x_row.clone()
    if p.logit_bias:
        z = hf_row(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()]), prompt + output, z)
    if p.allowed_token_ids is not None:
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        z = torch.where(keep, z, -math.inf)
    if p.bad_words_token_ids:
        z = hf_row(NoBadWordsLogitsProcessor(p.bad_words_token_ids), output, z)
    if p.min_tokens:
        z = hf_row(MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, [EOS, *p.stop_token_ids]),
                   prompt + output, z)
    if p.repetition_penalty != 1.0:
        z = hf_row(RepetitionPenaltyLogitsProcessor(p.repetition_penalty), prompt + output, z)
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).float()
    return z - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def mixed_params(temperature: float = 0.0, mode=LogprobsMode.PROCESSED) -> list[SamplingParams]:
    kw = dict(temperature=temperature, logprobs_mode=mode, max_tokens=32)
    return [
        SamplingParams(**kw),  # no processor: untouched
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2, logit_bias={4: 3.0}, **kw),
        SamplingParams(bad_words_token_ids=[[12], [5, 6]], min_tokens=20, stop_token_ids=[8], **kw),
        SamplingParams(allowed_token_ids=[3, 4, 5, 6, 7], repetition_penalty=0.7, **kw),
        SamplingParams(**kw),
        SamplingParams(logit_bias={15: -100.0, 16: 100.0}, frequency_penalty=-1.0, **kw),
    ]


@pytest.mark.parametrize("mode", [LogprobsMode.PROCESSED, LogprobsMode.RAW])
def test_processors_together_drive_greedy_choices_and_log_probs(mode):
    hist, x = history(7), logits_of(7)
    params = mixed_params(mode=mode)
    procs, _ = processors_of(params, hist)
    ref = torch.stack([hf_pipeline(p, pr, o, x[r]) for r, (p, (pr, o)) in enumerate(zip(params, hist))])
    batch = SamplingBatch.from_params(params)
    batch.processors = procs
    batch.num_top_logprobs = 3
    out = sample(x, batch)
    assert torch.allclose(apply_processors(x.clone(), procs), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out.token_ids, ref.argmax(-1))
    assert not torch.equal(out.token_ids, x.argmax(-1))  # the processors changed some choice
    dist = ref if mode is LogprobsMode.PROCESSED else x  # RAW: the model's own distribution
    lp = torch.log_softmax(dist.double(), -1)
    assert torch.allclose(out.logprobs.double(), lp.gather(1, out.token_ids[:, None])[:, 0], atol=1e-5, rtol=0)
    assert torch.allclose(out.top_logprobs.double(), lp.topk(3, -1).values, atol=1e-5, rtol=0)
    assert torch.equal(out.top_token_ids, dist.topk(3, -1).indices)
    plain = sample(x, SamplingBatch.from_params(params))  # the same batch without processors
    assert torch.equal(out.token_ids[[0, 4]], plain.token_ids[[0, 4]])
    # NOTE: a plain row beside processed ones is normalised in the batch's one raw read (the native
    # kernel where built); that sum's order may differ from torch's log_softmax by an ulp on some CPUs
    assert torch.allclose(out.logprobs[[0, 4]], plain.logprobs[[0, 4]], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_tokens_never_banned_and_native_path_agrees(dtype, native_kernels):
    hist = history(8, rows=12)
    x = (torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(8)) * 0.5).to(dtype)
    params = [SamplingParams(temperature=1.0, seed=100 + i, allowed_token_ids=[3, 4, 5, 6, 7, 8],
                             bad_words_token_ids=[[4]], logit_bias={5: 2.0}, repetition_penalty=1.2)
              for i in range(12)]
    procs, _ = processors_of(params, hist)
    batch = SamplingBatch.from_params(params)
    batch.processors = procs
    fast = sample(x, batch)
    assert set(fast.token_ids.tolist()) <= {3, 5, 6, 7, 8}
    with mock.patch.object(native, "usable", return_value=False):
        slow_batch = SamplingBatch.from_params(params)
        slow_batch.processors = procs
        slow = sample(x, slow_batch)
    assert torch.equal(fast.token_ids, slow.token_ids)
    assert torch.allclose(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)
    raw = torch.log_softmax(x.double(), -1).gather(1, fast.token_ids[:, None])[:, 0]
    assert torch.allclose(fast.logprobs.double(), raw, atol=1e-5, rtol=0)  # RAW: before the processors


def test_state_counts_grow_by_append_and_rows_are_reused():
    hist = history(9)
    params = [SamplingParams(frequency_penalty=1.0)] * ROWS
    _, state = processors_of(params, hist)
    _, rebound = processors_of(params, hist, incremental=False)
    for slot, (_, output) in enumerate(hist):
        want = {t: output.count(t) for t in set(output)}
        assert state.output_counts(slot) == want == rebound.output_counts(slot)
    rows_before = state.pair_of.shape[0]
    state.release(0)
    assert not state.uses[0] and state.pen_row[0] == -1 and state.output_counts(0) == {}
    for slot, (_, output) in list(enumerate(hist))[1:]:  # the others' entries moved, their index with them
        assert state.output_counts(slot) == {t: output.count(t) for t in set(output)}
        row = int(state.pen_row[slot])
        assert all(state.pairs.cols["token"][state.pair_of[row, t]] == t for t in set(output))
    state.bind(0, SamplingParams(repetition_penalty=0.5), np.array([3, 3, 4]), np.array([5], dtype=np.int64))
    assert state.pair_of.shape[0] == rows_before and state.output_counts(0) == {3: 0, 4: 0, 5: 1}
    state.append(np.array([0, 1]), np.array([5, 60]))
    assert state.output_counts(0) == {3: 0, 4: 0, 5: 2} and state.output_counts(1)[60] == 1
    state.bind(1, SamplingParams(), np.array([3]), np.array([], dtype=np.int64))  # a plain request: no state
    assert not state.uses[1] and state.pen_row[1] == -1 and state.output_counts(1) == {}
    state.reset()
    assert not state.uses.any() and (state.pen_row == -1).all() and state.pairs.slot.size == 0
    assert (state.pair_of == -1).all()


def test_a_batch_without_processors_builds_nothing():
    state = ProcessorState(4, VOCAB, (EOS,))
    for slot in range(4):
        state.bind(slot, SamplingParams(top_k=5, cache_salt="s"), np.array([3, 4]), np.array([], dtype=np.int64))
    assert state.for_rows(np.arange(4), np.zeros((4, 8), dtype=np.int64), np.full(4, 2), np.full(4, 2)) is None
    assert state.pair_of.shape[0] == 0
