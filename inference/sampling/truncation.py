"""Top-k, top-p and min-p as one per-row logit threshold: keep the tokens with x >= thr.

Each truncation keeps an upper set of the logits, so their composition is one threshold per row
(see the order and the tie rule in sampler.py). Top-k reads the k-th largest logit. Top-p builds
a histogram of each row's probability mass over log-probability bins: bins above the one where
the mass crosses p are kept, bins below are cut, and only the crossing bin's tokens are sorted.
So a nucleus of any width costs a few passes over the row, never a full sort (a window of the
top logits, then a full sort, cost 5x the multinomial baseline on wide nuclei).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

_NEG_INF = float("-inf")
_HIST_BINS = 2048  # bins of the mass histogram, over a row's log-probabilities (>= -_HIST_SPAN)
_HIST_SPAN = 32.0  # a token e^32 times less likely than the top one carries no float32 mass
_HIST_ROWS = 16  # rows per histogram pass, bounding its int64 bin-index temporaries


class TruncationParams(Protocol):
    """What the threshold needs of a `SamplingBatch`: per-row `[R]` tensors and three flags."""

    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool


def truncate(x: Tensor, w: Tensor, m: Tensor, inv_t: Tensor, batch: TruncationParams) -> Tensor:
    """Zero the weights `w = exp((x - m) / T)` of tokens cut by top-k / top-p / min-p; return the
    per-row logit threshold."""
    thr = torch.full_like(m, _NEG_INF)
    if batch.use_top_k or batch.use_top_p:
        thr = _top_k_top_p_threshold(x, w, m, inv_t, batch)
    if batch.use_min_p:
        # p_i >= min_p * p_max  <=>  (x_i - m) / T >= log(min_p); min_p = 0 gives -inf (off).
        thr = torch.maximum(thr, m + batch.min_p.log() / inv_t)
    w.masked_fill_(x < thr[:, None], 0.0)
    return thr


def _top_k_top_p_threshold(x: Tensor, w: Tensor, m: Tensor, inv_t: Tensor, batch: TruncationParams) -> Tensor:
    """Per-row logit threshold of top-k then top-p (top-p renormalised over the top-k survivors)."""
    vocab = x.shape[1]
    top_k, top_p = batch.top_k, batch.top_p
    kth = torch.full_like(m, _NEG_INF)
    if batch.use_top_k:
        k_eff = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        vals = x.topk(int(k_eff[top_k > 0].max()), dim=-1).values  # sorted descending
        kth = torch.where(top_k > 0, vals.gather(1, (k_eff.clamp(max=vals.shape[1]) - 1)[:, None])[:, 0], kth)
        if not batch.use_top_p:
            return kth
        w.masked_fill_(x < kth[:, None], 0.0)
    rows = (top_p < 1).nonzero()[:, 0]
    if rows.numel() == x.shape[0]:  # NOTE: the common case; indexing would copy every row
        return torch.maximum(kth, _nucleus_by_histogram(x, w, m, inv_t, top_p * w.sum(-1), kth))
    thr_p = torch.full_like(m, _NEG_INF)
    xs, ws = x[rows], w[rows]
    thr_p[rows] = _nucleus_by_histogram(xs, ws, m[rows], inv_t[rows], top_p[rows] * ws.sum(-1), kth[rows])
    return torch.maximum(kth, thr_p)


def _nucleus_by_histogram(x: Tensor, w: Tensor, m: Tensor, inv_t: Tensor, target: Tensor, kth: Tensor) -> Tensor:
    """Top-p thresholds of rows whose nucleus is wide. `target` is top_p times each row's weight
    sum: token i is kept while the weight of the tokens strictly likelier than it is below target."""
    out = torch.empty_like(m)
    for start in range(0, x.shape[0], _HIST_ROWS):
        sl = slice(start, start + _HIST_ROWS)
        xs, ms, its, tgt, kths = x[sl], m[sl], inv_t[sl], target[sl].double(), kth[sl]
        # NOTE: the bins span each row's own range of log-probabilities (at most _HIST_SPAN), so a
        # flat row spreads over all bins instead of crowding a few
        span = ((ms - xs.amin(-1)) * its).clamp_(min=1e-30, max=_HIST_SPAN)
        bins = torch.sub(ms[:, None], xs).mul_((its * _HIST_BINS / span)[:, None]).clamp_(max=_HIST_BINS).long()
        mass = torch.zeros(xs.shape[0], _HIST_BINS + 1, dtype=torch.float64)
        mass.scatter_add_(1, bins, w[sl].double())
        cum = mass.cumsum(1)
        crossing = (cum < tgt[:, None]).sum(1).clamp_(max=_HIST_BINS)  # first bin whose cum reaches target
        before = torch.where(crossing > 0, cum.gather(1, (crossing - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        # the crossing bin's tokens (few), sorted by row, then by value descending
        row, col = ((bins == crossing[:, None]) & (xs >= kths[:, None])).nonzero(as_tuple=True)
        v = xs[row, col]
        by_value = torch.argsort(v, descending=True, stable=True)
        order = by_value[torch.argsort(row[by_value], stable=True)]
        v, row = v[order], row[order]
        weight = ((v - ms[row]) * its[row]).exp_().double()
        csum = weight.cumsum(0)
        first = torch.bincount(row, minlength=xs.shape[0]).cumsum(0)
        first = torch.cat((first.new_zeros(1), first[:-1]))  # each row's first entry
        row_start = torch.where(first > 0, csum[(first - 1).clamp(min=0)], 0.0)
        above = before[row] + (csum - weight) - row_start[row]  # weight strictly likelier, per row
        kept = torch.bincount(row, weights=(above < tgt[row]).double(), minlength=xs.shape[0]).long()
        out[sl] = v[first + kept.clamp(min=1) - 1]
    return out
