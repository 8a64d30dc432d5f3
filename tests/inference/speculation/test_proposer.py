"""N-gram proposals and the prompt history against brute-force definitions."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.speculation.history import PromptHistory
from inference.speculation.proposer import SEP, build_corpus, propose
from inference.speculation.verify import accepted_counts, cut_at_stops


def brute_force(suffix, corpus, k, lo, hi):
    """The continuation of the latest longest match, by scanning every position."""
    best, best_len = None, 0
    for i in range(len(corpus) - 1):
        if corpus[i + 1] == SEP:
            continue
        n = 0
        while n < min(hi, len(suffix)) and i - n >= 0 and corpus[i - n] == suffix[-1 - n]:
            n += 1
        if n >= lo and n >= best_len:
            best, best_len = i, n
    if best is None:
        return []
    out = []
    for t in corpus[best + 1 : best + 1 + k]:
        if t == SEP:
            break
        out.append(t)
    return out


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=30)


@settings(max_examples=300, deadline=None)
@given(seqs=st.lists(tokens, min_size=1, max_size=4), k=st.integers(1, 6), lo=st.integers(1, 3),
       extra=st.integers(0, 4))
def test_proposal_is_the_latest_longest_match(seqs, k, lo, extra):
    corpus = build_corpus([np.array(s, dtype=np.int64) for s in seqs])
    suffix = np.array(seqs[-1], dtype=np.int64)
    got = propose(suffix, corpus, k, lo, lo + extra).tolist()
    assert got == brute_force(suffix.tolist(), corpus.tolist(), k, lo, lo + extra)


def test_siblings_continue_a_shared_phrase():
    sibling = np.array([5, 6, 7, 8, 9, 10, 11])
    own = np.array([1, 2, 6, 7, 8])
    assert propose(own, build_corpus([sibling, own]), 3, 2, 4).tolist() == [9, 10, 11]
    assert propose(own, build_corpus([sibling, own]), 8, 2, 4).tolist() == [9, 10, 11]  # stops at the sequence's end
    assert propose(np.array([1, 2, 3]), build_corpus([sibling, np.array([1, 2, 3])]), 3, 2, 4).size == 0


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
