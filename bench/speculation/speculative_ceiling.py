"""How much faster any draft-free proposal could make a batch's tail: an oracle bound, from outputs.

A verify step keeps a request's proposed tokens up to the first that differs from the target's own
sample, plus one. Given the tokens a batch actually sampled (speculation does not change them), the
best any proposer drawing from a corpus could do is known after the fact: at each position, among
every place in the corpus where the request's last `min_match` tokens occur, take the continuation
that agrees longest with what was sampled (`tree`: what verifying every such continuation at once
would keep). `chain` is the engine's own proposer (`inference.speculation.proposer.propose`) with
all its `num_tokens` proposals verified.

The corpus is what the speculative engine drafts from, made optimistic: earlier samples of the
prompt (`history`), every other sample of the prompt in this batch in full (the engine sees only
what a sibling has generated so far), and the request's own tokens so far.

The tail is what a batch does after 90% of its samples finished. Without speculation every live
sample gains one token a step, so the tail is `longest - L90` steps (L90: the length the 90%-th
sample reached). With the oracle each sample needs fewer steps for its tokens past L90; the tail
takes as many as the slowest needs. `tail_bound` = plain tail steps / oracle tail steps: the tail's
speed-up if verify steps cost no more than plain ones, an upper bound for any proposal the corpus
holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from inference.speculation.proposer import build_corpus, propose


def tree_kept(seq: np.ndarray, t: int, corpus: np.ndarray, num_tokens: int, min_match: int) -> int:
    """Proposed tokens the best continuation in `corpus` of `seq[t - min_match : t]` would have kept."""
    if t < min_match or corpus.size <= min_match:
        return 0
    windows = np.lib.stride_tricks.sliding_window_view(corpus[:-1], min_match)
    starts = np.flatnonzero((windows == seq[t - min_match : t]).all(axis=1)) + min_match
    kept = np.zeros(starts.size, dtype=np.int64)
    alive = np.ones(starts.size, dtype=bool)
    for j in range(min(num_tokens, seq.size - t)):
        at = starts + j
        ok = alive & (at < corpus.size)
        ok[ok] = corpus[at[ok]] == seq[t + j]
        kept += ok
        alive = ok
        if not alive.any():
            break
    return int(kept.max()) if kept.size else 0


def chain_kept(seq: np.ndarray, t: int, corpus: np.ndarray, num_tokens: int, min_match: int, max_match: int) -> int:
    """Proposed tokens the engine's proposer would have had kept at position `t` (all verified)."""
    draft, _ = propose(seq[max(0, t - max_match) : t], corpus, num_tokens, min_match, max_match)
    same = draft == seq[t : t + draft.size] if t + draft.size <= seq.size else np.zeros(draft.size, dtype=bool)
    return int(draft.size if same.all() else np.argmin(same))


def oracle_steps(seq: np.ndarray, start: int, sources: list[np.ndarray], kind: str, num_tokens: int,
                 min_match: int, max_match: int) -> int:
    """Verify steps the `kind` oracle (`tree` or `chain`) needs to produce `seq[start:]`."""
    steps, t = 0, start
    while t < seq.size:
        corpus = build_corpus([*sources, seq[:t]])
        kept = (tree_kept(seq, t, corpus, num_tokens, min_match) if kind == "tree"
                else chain_kept(seq, t, corpus, num_tokens, min_match, max_match))
        t += kept + 1
        steps += 1
    return steps


def tail_bound(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
               history: dict[tuple[int, ...], list[np.ndarray]], *, kind: str, num_tokens: int, min_match: int,
               max_match: int, tail_fraction: float = 0.9) -> dict[str, float]:
    """`{plain_steps, oracle_steps, tail_bound, tokens_per_step}` of one batch's tail (module docstring).

    `prompts[i]` and `outputs[i]` (generated tokens) are sample i's; `history` maps a prompt to
    earlier samples of it, as the speculative engine would hold them."""
    lengths = np.array([len(o) for o in outputs])
    l90 = int(np.sort(lengths)[max(0, math.ceil(tail_fraction * lengths.size) - 1)])
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_prompt.setdefault(tuple(prompt), []).append(i)
    worst = tail_tokens = total_steps = 0
    for i in np.flatnonzero(lengths > l90).tolist():
        key = tuple(prompts[i])
        siblings = [np.asarray(outputs[j], dtype=np.int64) for j in by_prompt[key] if j != i]
        seq = np.asarray([*prompts[i], *outputs[i]], dtype=np.int64)
        steps = oracle_steps(seq, len(prompts[i]) + l90, history.get(key, []) + siblings, kind, num_tokens,
                             min_match, max_match)
        worst = max(worst, steps)
        tail_tokens += int(lengths[i]) - l90
        total_steps += steps
    plain = int(lengths.max()) - l90
    return {"plain_steps": plain, "oracle_steps": worst, "tail_bound": plain / worst if worst else 1.0,
            "tokens_per_step": tail_tokens / total_steps if total_steps else 1.0}
