"""bench/speculation/speculative_ceiling.py: the oracle's steps on inputs whose answer is known by hand."""

from __future__ import annotations

import numpy as np

from bench.speculation.speculative_ceiling import oracle_steps, tail_bound, tree_kept  # noqa: E402

PROMPT = [1, 2, 3]


def test_a_sample_its_sibling_repeats_is_kept_num_tokens_at_a_time():
    generated = list(range(10, 40))  # 30 distinct tokens, the sibling holds them all
    seq = np.array(PROMPT + generated)
    for k in (1, 3, 8):
        for kind in ("tree", "chain"):
            steps = oracle_steps(seq, len(PROMPT), [np.array(generated)], kind, k, min_match=1, max_match=8)
            # NOTE: the first step has only the prompt's last token to match, which the sibling lacks
            assert steps == 1 + -(-(len(generated) - 1) // (k + 1)), (kind, k)


def test_nothing_to_match_is_one_token_a_step():
    seq = np.arange(100, 140)
    assert oracle_steps(seq, 5, [np.arange(200, 260)], "tree", 8, min_match=1, max_match=8) == 35
    assert oracle_steps(seq, 5, [], "chain", 8, min_match=2, max_match=8) == 35


def test_the_tree_takes_the_continuation_that_agrees_longest():
    # "7 8" continues three ways in the corpus; what was sampled follows the rarest one for 3 tokens
    corpus = np.array([7, 8, 1, 1, -1, 7, 8, 1, 2, -1, 7, 8, 5, 6, 9, 0])
    seq = np.array([7, 8, 5, 6, 9, 4])
    assert tree_kept(seq, 2, corpus, num_tokens=8, min_match=2) == 3
    assert tree_kept(seq, 2, corpus, num_tokens=2, min_match=2) == 2


def test_tail_bound_counts_the_tail_past_the_ninetieth_sample():
    # ten samples of one prompt: nine of 5 tokens, one of 25 that repeats the history's sample
    long = list(range(50, 75))
    outputs = [[90 + i] * 5 for i in range(9)] + [long]
    prompts = [PROMPT] * 10
    plain = tail_bound(prompts, outputs, {}, kind="tree", num_tokens=4, min_match=1, max_match=8)
    assert plain["plain_steps"] == 20 and plain["tail_bound"] == 1.0
    known = tail_bound(prompts, outputs, {tuple(PROMPT): [np.array(long)]}, kind="tree", num_tokens=4,
                       min_match=1, max_match=8)
    assert known["oracle_steps"] == 4 and known["tail_bound"] == 5.0 and known["tokens_per_step"] == 5.0
