"""Log-probs in the shapes clients read: OpenAI's completion and chat `logprobs`, vLLM's `prompt_logprobs`.

* Every top list holds the sampled (or, for a prompt, the actual) token, as vLLM's do: a completion
  position's dict is that token first, then the `k` most likely (k or k + 1 entries; `logprobs: 0`
  gives the token alone); a chat position's list is the `k` most likely, then the sampled token
  when it is not among them (`top_logprobs: 0` gives `[]`, as OpenAI and vLLM do).
* `echo` prefixes a completion's log-probs with its prompt's: the first prompt token has none
  (`null` log-prob and top entry: nothing predicts it).
* vLLM's `prompt_logprobs`: one entry per prompt token, the first `null`, each
  `{token id: {"logprob", "rank", "decoded_token"}}` with the prompt's token and the `k` most
  likely. `rank` is vLLM's: the top `k` are ranked 1..k in order; the prompt's token by the
  engine's count of the vocabulary entries whose log-prob is >= its own (a tie counts ahead),
  computed where it was scored (over the wire and from the prefix cache too), never null.
"""

from __future__ import annotations

from typing import Any, Optional

TopRow = Optional[dict[int, float]]


def ranked(top: TopRow, k: int) -> list[tuple[int, float]]:
    """The `k` most likely (token id, log-prob) of one position, most likely first."""
    if not top or k <= 0:
        return []
    return sorted(top.items(), key=lambda kv: -kv[1])[:k]


def completion_top(top: TopRow, k: int, token: int, logprob: float) -> list[tuple[int, float]]:
    """A completion position's entries: `token` first, then the `k` most likely others."""
    return [(token, logprob), *((t, lp) for t, lp in ranked(top, k) if t != token)]


def chat_top(top: TopRow, k: int, token: int, logprob: float) -> list[tuple[int, float]]:
    """A chat position's entries: the `k` most likely, then `token` when not among them."""
    if k <= 0:
        return []
    best = ranked(top, k)
    return best if any(t == token for t, _ in best) else [*best, (token, logprob)]


def prompt_entries(prompt: list[int], scores: Optional[list[TopRow]], k: int, text: Any,
                   vocab_ranks: Optional[list[Optional[int]]] = None) -> Optional[list]:
    """vLLM's `prompt_logprobs` of `prompt` from the engine's `scores` and each prompt token's
    `vocab_ranks` (see module docstring); `text(token_id)` is a token's decoded text."""
    if scores is None:
        return None
    out: list[Optional[dict[str, dict]]] = [None]
    vocab_ranks = vocab_ranks if vocab_ranks is not None else [None] * len(prompt)
    for token, row, vocab_rank in zip(prompt[1:], scores[1:], vocab_ranks[1:]):
        row = row or {}
        best = ranked(row, k)  # NOTE: the row is the token and the true top k: its k best are those
        ranks = {t: i + 1 for i, (t, _) in enumerate(best)}
        # NOTE: the prompt's token always by its count over the vocabulary (a tie counts ahead), also
        # among the top k, where a tie's place in the list would be arbitrary
        rank = vocab_rank if vocab_rank is not None else ranks.get(token)
        entry = {str(token): {"logprob": row.get(token), "rank": rank, "decoded_token": text(token)}}
        for t, lp in best:
            entry.setdefault(str(t), {"logprob": lp, "rank": ranks[t], "decoded_token": text(t)})
        out.append(entry)
    return out


def echoed_prompt(prompt: list[int], scores: Optional[list[TopRow]], k: int, text: Any
                  ) -> tuple[list[str], list[Optional[float]], list[Optional[dict[str, float]]]]:
    """The prompt's part of an echoed completion's log-probs: tokens, their log-probs, top dicts."""
    tokens = [text(t) for t in prompt]
    rows = scores if scores is not None else [None] * len(prompt)
    lps: list[Optional[float]] = [None]
    tops: list[Optional[dict[str, float]]] = [None]
    for token, row in zip(prompt[1:], rows[1:]):
        row = row or {}
        lp = row.get(token)
        lps.append(lp)
        tops.append({text(t): v for t, v in completion_top(row, k, token, lp)})
    return tokens, lps, tops
