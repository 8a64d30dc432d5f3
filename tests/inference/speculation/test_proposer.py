"""N-gram proposals and the prompt history against brute-force definitions."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.speculation.history import PromptHistory
from inference.speculation.proposer import SEP, build_corpus, propose
from inference.speculation.verify import accepted_counts, cut_at_stops


def brute_force(suffix, corpus, k, lo, hi, min_chance=0.0):
    """The vote walk (`propose`'s docstring) over every position, by scanning."""

    def continues(i):  # position i ends a match with a continuation
        return i + 1 < len(corpus) and corpus[i + 1] != SEP and corpus[i] != SEP

    def match_len(i):
        n = 0
        while n < min(hi, len(suffix)) and i - n >= 0 and corpus[i - n] == suffix[-1 - n]:
            n += 1
        return n

    ends = [i for i in range(len(corpus)) if continues(i) and match_len(i) >= lo]
    if not ends:
        return [], []
    longest = max(match_len(i) for i in ends)
    live = [i for i in ends if match_len(i) == longest]
    tokens, chances, chance = [], [], 1.0
    while live and len(tokens) < k:
        nxt = [corpus[i + 1] for i in live]
        top = max(nxt.count(t) for t in nxt)
        token = [t for t in nxt if nxt.count(t) == top][-1]  # a tie: the latest match's
        chance *= top / (len(live) + 1)
        if chance < min_chance:
            break
        tokens.append(token)
        chances.append(chance)
        live = [i + 1 for i in live if corpus[i + 1] == token and continues(i + 1)]
    return tokens, chances


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=30)


@settings(max_examples=300, deadline=None)
@given(seqs=st.lists(tokens, min_size=1, max_size=4), k=st.integers(1, 6), lo=st.integers(1, 3),
       extra=st.integers(0, 4), min_chance=st.sampled_from([0.0, 0.05, 0.3]))
def test_proposal_is_the_vote_over_the_longest_matches(seqs, k, lo, extra, min_chance):
    corpus = build_corpus([np.array(s, dtype=np.int64) for s in seqs])
    suffix = np.array(seqs[-1], dtype=np.int64)
    got, chances = propose(suffix, corpus, k, lo, lo + extra, min_chance)
    want, want_chances = brute_force(suffix.tolist(), corpus.tolist(), k, lo, lo + extra, min_chance)
    assert got.tolist() == want
    np.testing.assert_allclose(chances, want_chances, rtol=1e-12)


def test_the_majority_continuation_wins_with_its_share():
    # "1 2" continued with 3 twice and with 4 once (the latest): 3 is proposed, chance 2 / (3 + 1)
    corpus = build_corpus([np.array([1, 2, 3, 5]), np.array([1, 2, 3, 6]), np.array([1, 2, 4]), np.array([1, 2])])
    got, chances = propose(np.array([1, 2]), corpus, 4, 2, 4)
    assert got.tolist()[:1] == [3]
    assert chances[0] == 2 / 4
    # then the two matches that said 3 split 5 / 6: a tie, the latest (6), chance 1/2 * 1/3
    assert got.tolist() == [3, 6] and chances[1] == 2 / 4 * 1 / 3


def test_siblings_continue_a_shared_phrase():
    sibling = np.array([5, 6, 7, 8, 9, 10, 11])
    own = np.array([1, 2, 6, 7, 8])
    assert propose(own, build_corpus([sibling, own]), 3, 2, 4)[0].tolist() == [9, 10, 11]
    assert propose(own, build_corpus([sibling, own]), 8, 2, 4)[0].tolist() == [9, 10, 11]  # stops at the sequence's end
    assert propose(np.array([1, 2, 3]), build_corpus([sibling, np.array([1, 2, 3])]), 3, 2, 4)[0].size == 0
    assert propose(own, build_corpus([sibling, own]), 8, 2, 4, min_chance=0.2)[0].tolist() == [9, 10]  # 1/2, 1/4, 1/8


def test_history_is_bounded_per_prompt_and_in_prompts():
    history = PromptHistory(samples=2, prompts=2)
    for i in range(3):
        history.add((1, 2), np.array([i]))
    assert [h.tolist() for h in history.of((1, 2))] == [[1], [2]]
    history.add((3,), np.array([7]))
    history.of((1, 2))
    history.add((1, 2), np.array([9]))  # (1, 2) used most recently: (3,) goes first
    history.add((4,), np.array([8]))
    assert history.of((3,)) == [] and len(history) == 2
    history.add((5,), np.empty(0, dtype=np.int64))  # nothing generated: nothing kept
    assert history.of((5,)) == []


def test_accepted_counts_and_stops():
    sampled = np.array([4, 5, 6, 9, 1, 2, 3])
    drafts = [np.array([4, 5, 7]), np.empty(0, dtype=np.int64), np.array([1, 2])]
    starts = np.array([0, 3, 4])  # rows: request 0 has 4 (its last token + 3 proposals), 1 has 1, 2 has 3
    accepted = accepted_counts(sampled, drafts, starts)
    assert accepted.tolist() == [2, 0, 2]
    is_stop = np.array([False, True, False, False, False, False, False])
    assert cut_at_stops(accepted + 1, is_stop, starts).tolist() == [2, 1, 3]
