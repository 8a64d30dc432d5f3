"""Vectorised sampler over `[R, V]` logits: processors, temperature, top-k, top-p, min-p, seeds, log-probs.

Per row, with x = the row's logits in float32 and T its temperature (T = 1 for greedy rows):
  0. the logit processors (logit_bias, allowed_token_ids, bad words, min_tokens, penalties; see
     processors.py) turn the raw logits into x, on a copy, for the rows that use them (as vLLM).
  1. z = x / T.
  2. top-k: keep tokens with x >= the k-th largest x (ties at the boundary are all kept).
  3. top-p: over the top-k survivors, renormalised, keep token i when the mass of the tokens
     strictly more likely than i is < p: the smallest nucleus reaching p, boundary ties kept.
  4. min-p: keep tokens with prob >= min_p * max prob. Renormalising keeps ratios and the top
     token survives 2-3, so this is z_i >= max z + log(min_p) whatever came before.
Each step keeps an upper set of x, so the whole truncation is one per-row threshold: keep x >= thr.
Greedy rows (T = 0) take argmax(x); truncation never removes the argmax, so the order is moot there.

Log-probs: RAW is `log_softmax` of the model's raw logits (before any processor: what a trainer
recomputes from the same weights); PROCESSED is the distribution actually sampled from, after the
processors, temperature and truncation (tokens banned or cut away have log-prob -inf). So the top-n
of a RAW row are the raw distribution's top-n, those of a PROCESSED row the processed one's.

Random rows sample by inverse CDF from one float64 uniform per row, in two levels (chunk of
`_CHUNK` tokens, then the token inside it) so the cumulative sums are short and float64-exact.
NOTE: chosen over the exponential race (argmax(p / Exp(1))), which needs V random numbers per
row; on CPU drawing them costs ~8x the softmax. A seeded row draws its uniform from its own
generator (exactly one draw per sampled token) and everything else it uses is computed within its
row, so its token depends only on its logits row and its generator, never on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.sampling import native
from inference.sampling.batch import SamplingBatch
from inference.sampling.processors import apply_processors
from inference.sampling.truncation import truncate

_CHUNK = 256  # tokens per first-level bucket of the inverse-CDF draw
_PROMPT_ROWS = 256  # rows per pass in compute_prompt_logprobs, bounding its float32 temporaries
_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplerOutput:
    """`token_ids [R] int64`; `logprobs [R] float32` of each sampled token in the row's mode;
    `top_logprobs [R, n] float32` (descending) and `top_token_ids [R, n] int64`, None when n == 0.
    In PROCESSED mode, top-n entries cut away by truncation have log-prob -inf."""

    token_ids: Tensor
    logprobs: Tensor
    top_logprobs: Tensor | None
    top_token_ids: Tensor | None


@dataclass(slots=True)
class PromptLogprobs:
    """Raw log-probs of each prompt position's next token: `logprobs [P]`, top-n `[P, n]` or None,
    and `ranks [P]` (int64), each token's rank in the vocabulary as vLLM counts it: the entries
    whose log-prob is >= the token's (1 = most likely; a tie counts ahead)."""

    logprobs: Tensor
    top_logprobs: Tensor | None
    top_token_ids: Tensor | None
    ranks: Tensor


class Sampler:
    """`sample` with a float32 workspace kept across steps (grown on demand, never shrunk).

    NOTE: on CPU a fresh `[R, V]` float32 buffer per step costs page faults on the order of the
    exp pass itself, so the engine holds one of these; `release()` frees it (engine suspend).
    """

    __slots__ = ("_workspace",)

    def __init__(self) -> None:
        self._workspace: Tensor | None = None

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        need = _workspace_numel(logits, batch.processors is not None)
        ws = self._workspace
        if ws is None or ws.numel() < need or ws.device != logits.device:
            ws = self._workspace = torch.empty(need, dtype=torch.float32, device=logits.device)
        return sample(logits, batch, workspace=ws)

    def release(self) -> int:
        """Drop the workspace (engine suspend); returns its bytes."""
        ws, self._workspace = self._workspace, None
        return 0 if ws is None else ws.numel() * ws.element_size()


def sample(logits: Tensor, batch: SamplingBatch, workspace: Tensor | None = None) -> SamplerOutput:
    """Sample one token per row of `logits [R, V]` (any float dtype; all maths in float32).

    `workspace`, if given, is a float32 tensor of at least `_workspace_numel(logits)` elements
    that this call overwrites. `logits` itself is never modified.
    """
    rows, vocab = logits.shape
    chunk = min(_CHUNK, max(vocab, 1))
    padded = _padded(vocab)
    n_chunks = padded // chunk
    processing = batch.processors is not None
    if workspace is None:
        workspace = torch.empty(_workspace_numel(logits, processing), dtype=torch.float32, device=logits.device)
    x = logits
    end = rows * padded
    if x.dtype != torch.float32:
        # NOTE: one float32 copy is cheaper than the mixed-dtype ops (sub, compare, argmax) it saves.
        x = workspace[end: end + rows * vocab].view(rows, vocab).copy_(logits)
        end += rows * vocab
    x_raw = x  # the model's logits (float32): RAW log-probs are theirs
    if processing:
        x = apply_processors(workspace[end: end + rows * vocab].view(rows, vocab).copy_(x_raw), batch.processors)
    t = batch.temperature
    inv_t = torch.where(t == 0, torch.ones_like(t), t).reciprocal()
    truncating = batch.use_top_k or batch.use_top_p or batch.use_min_p
    w_full = workspace[: rows * padded].view(rows, padded)
    w = w_full[:, :vocab]
    thr = None
    raw_log_norm = None  # log sum exp(x - max x), for RAW log-probs
    if not truncating and not batch.all_greedy and native.usable(x):
        # NOTE: the native path draws from the same uniforms by the same inverse CDF (native.py)
        token_ids, m, total, raw_total = native.sample_rows(
            x, inv_t, _row_uniforms(batch, rows, x.device), raw=batch.need_raw and not processing)
        if raw_total is not None:
            raw_log_norm = raw_total.log().float()
    else:
        m = x.amax(-1)
        # w = exp(z - max z): unnormalised probs, in a buffer padded with zeros to whole chunks.
        w_full[:, vocab:].zero_()
        torch.sub(x, m[:, None], out=w)
        if not batch.unit_temperature:
            w.mul_(inv_t[:, None])
        w.exp_()
        if batch.need_raw and batch.unit_temperature and truncating and not processing:
            raw_log_norm = w.sum(-1).log()  # w is still exp(x - m): reuse it before it is cut
        thr = truncate(x, w, m, inv_t, batch) if truncating else None
        chunk_sums = w_full.view(rows, n_chunks, chunk).sum(-1).double()
        cdf = chunk_sums.cumsum(-1)
        total = cdf[:, -1]
        u = _row_uniforms(batch, rows, x.device)
        if batch.all_greedy:
            token_ids = x.argmax(-1)
        else:
            token_ids = _inverse_cdf(w_full.view(rows, n_chunks, chunk), chunk_sums, cdf, total, u)
    if batch.any_greedy and not batch.all_greedy:
        token_ids = torch.where(t == 0, x.argmax(-1), token_ids)
    log_total = total.log().float()  # log normaliser of the processed distribution, in z units
    raw_lse = None  # log sum exp of the raw logits, in x units
    if batch.need_raw:
        if processing:
            raw_lse = _log_normaliser(x_raw)
        else:
            if raw_log_norm is None:
                # w is spent once the tokens are drawn; reuse its storage for exp(x - m).
                raw_log_norm = log_total if batch.unit_temperature else \
                    torch.sub(x, m[:, None], out=w).exp_().sum(-1).log()
            raw_lse = m + raw_log_norm
    x_tok = x.gather(1, token_ids[:, None])[:, 0]
    x_raw_tok = x_raw.gather(1, token_ids[:, None])[:, 0] if processing else x_tok
    logprobs = _select(batch, lambda: x_raw_tok - raw_lse,
                       lambda: (x_tok - m) * inv_t - log_total)
    n = min(batch.num_top_logprobs, vocab)
    if n == 0:
        return SamplerOutput(token_ids, logprobs, None, None)
    # NOTE: x and z = x / T order tokens alike, and the kept set is an upper set of x, so one
    # top-n of x serves both modes; only the values differ. Processors reorder tokens: then RAW
    # rows take the top-n of the raw logits.
    top_x, top_ids = x.topk(n, dim=-1)
    raw_x, raw_ids = x_raw.topk(n, dim=-1) if processing and batch.need_raw else (top_x, top_ids)

    def processed_top() -> Tensor:
        top = (top_x - m[:, None]) * inv_t[:, None] - log_total[:, None]
        return top if thr is None else top.masked_fill_(top_x < thr[:, None], _NEG_INF)

    top = _select(batch, lambda: raw_x - raw_lse[:, None], processed_top)
    if raw_ids is not top_ids:
        top_ids = _select(batch, lambda: raw_ids, lambda: top_ids)
    return SamplerOutput(token_ids, logprobs, top, top_ids)


def compute_prompt_logprobs(logits: Tensor, target_ids: Tensor, num_top: int = 0) -> PromptLogprobs:
    """Raw log-probs of `target_ids [P]` under `logits [P, V]` (row i predicts target i), plus
    the top-`num_top` alternatives. Works on `_PROMPT_ROWS` rows at a time to bound memory."""
    n = min(num_top, logits.shape[-1])
    lps, tops, ids, ranks = [], [], [], []
    for start in range(0, logits.shape[0], _PROMPT_ROWS):
        x = logits[start:start + _PROMPT_ROWS]
        log_z = _raw_log_z(x)
        lp = x.gather(1, target_ids[start:start + _PROMPT_ROWS, None]).float() - log_z
        lps.append(lp[:, 0])
        # NOTE: compared as log-probs, not logits: two logits that round to one log-prob tie, as in vLLM
        ranks.append(x.to(torch.float32, copy=True).sub_(log_z).ge(lp).sum(-1))
        if n:
            top_x, top_ids = x.topk(n, dim=-1)
            tops.append(top_x.float() - log_z)
            ids.append(top_ids)
    if not lps:  # no prompt rows: keep the shapes' trailing dims
        lps, tops, ids = [logits.new_empty(0).float()], [logits.new_empty(0, n).float()], [target_ids.new_empty(0, n)]
        ranks = [target_ids.new_empty(0)]
    return PromptLogprobs(torch.cat(lps), torch.cat(tops) if n else None, torch.cat(ids) if n else None,
                          torch.cat(ranks))


def raw_logprobs(logits: Tensor, target_ids: Tensor) -> Tensor:
    """RAW log-probs `[P]` of `target_ids [P]` under `logits [P, V]`: at T = 1 the bits the sampler
    gives a token it samples (its own normaliser), as `compute_prompt_logprobs` scores prompts."""
    return logits.gather(1, target_ids[:, None]).float()[:, 0] - _raw_log_z(logits)[:, 0]


def processed_logprobs(logits: Tensor, target_ids: Tensor, temperature: float) -> Tensor:
    """PROCESSED log-probs `[P]` of `target_ids [P]` under `logits [P, V]` at `temperature` (no logit
    processors, no truncation): the bits `sample` gives a token it samples there (the native kernel's
    max and weight sum, which the draw does not change). Needs the native kernels."""
    x = logits.float()
    if not native.usable(x):
        raise ValueError("processed_logprobs needs the native sampling kernel (its sums are the sampler's)")
    rows = x.shape[0]
    inv_t = torch.full((rows,), temperature, dtype=torch.float32, device=x.device).reciprocal()
    _, m, total, _ = native.sample_rows(x, inv_t, torch.zeros(rows, dtype=torch.float64))
    return (x.gather(1, target_ids[:, None])[:, 0] - m) * inv_t - total.log().float()


def _raw_log_z(x: Tensor) -> Tensor:
    """`[P, 1]` float32 log normaliser of the rows of `x`."""
    if native.usable(xf := x.float()):  # NOTE: the sampler's own normaliser: a scored token's log-prob is
        return _log_normaliser(xf)[:, None]  # the bits it was sampled with (T = 1, RAW)
    m = x.amax(-1, keepdim=True).float()
    return m + torch.sub(x, m).exp_().sum(-1, keepdim=True).log()


def _log_normaliser(x: Tensor) -> Tensor:
    """log sum exp of each row of float32 `x`, in one read of it where the native kernel runs.
    NOTE: the kernel's own max and weight sum at T = 1 are this normaliser (its sampled token is
    dropped); `torch.logsumexp` costs ~8x one read on CPU."""
    if native.usable(x):
        rows = x.shape[0]
        _, m, total, _ = native.sample_rows(x, torch.ones(rows), torch.zeros(rows, dtype=torch.float64))
        return m + total.log().float()
    return torch.logsumexp(x, -1)


def _workspace_numel(logits: Tensor, processing: bool = False) -> int:
    """Float32 elements `sample` needs: the padded weights, a float32 copy of other dtypes, and
    with `processing` the processed copy of the logits."""
    rows, vocab = logits.shape
    return rows * (_padded(vocab) + (0 if logits.dtype == torch.float32 else vocab) + (vocab if processing else 0))


def _padded(vocab: int) -> int:
    """Row length of the weight buffer: whole chunks of min(_CHUNK, vocab) tokens."""
    chunk = min(_CHUNK, max(vocab, 1))
    return -(-vocab // chunk) * chunk


def _select(batch: SamplingBatch, raw, processed) -> Tensor:
    """Compute only the log-prob mode(s) the batch asks for; mix per row when both are."""
    if not batch.need_processed:
        return raw()
    if not batch.need_raw:
        return processed()
    proc, raw_ = processed(), raw()
    mask = batch.logprobs_mode
    return torch.where(mask.view(-1, *([1] * (proc.dim() - 1))), proc, raw_)


def _row_uniforms(batch: SamplingBatch, rows: int, device: torch.device) -> Tensor:
    """The batch's preset uniforms, else one drawn per row (`_uniforms`)."""
    return _uniforms(rows, batch.generators, device) if batch.uniforms is None else batch.uniforms.to(device)


def _uniforms(rows: int, generators: Sequence[torch.Generator | None], device: torch.device) -> Tensor:
    """One float64 uniform in [0, 1) per row; seeded rows draw exactly one from their generator."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) == rows:
        u = torch.empty(rows, dtype=torch.float64, device=device)
    else:
        u = torch.rand(rows, dtype=torch.float64, device=device)
    if seeded:
        draws = [torch.rand((), dtype=torch.float64, generator=generators[i], device=generators[i].device)
                 for i in seeded]
        u[torch.tensor(seeded, device=device)] = torch.stack(draws).to(device)
    return u


def _inverse_cdf(w3: Tensor, chunk_sums: Tensor, cdf: Tensor, total: Tensor, u: Tensor) -> Tensor:
    """Token index whose cumulative weight interval holds u * total; zero-weight tokens never win."""
    rows, _, chunk = w3.shape
    idx = torch.arange(rows, device=w3.device)
    # NOTE: u < 1, yet u * total may round up to total; keep the target strictly inside the mass.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # NOTE: clamped: a row whose mass does not add up (inf / nan weights from extreme parameters)
    # would index past its last chunk and fail the whole step; it gets its last token instead
    c = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=cdf.shape[1] - 1)
    before = torch.where(c > 0, cdf[idx, (c - 1).clamp(min=0)], 0.0)
    inner = w3[idx, c].double().cumsum(-1)
    inner_total = inner[:, -1]
    # Rescale the residual from the float32 chunk sum to this float64 cumsum of the same chunk.
    rem = (target - before) / chunk_sums[idx, c] * inner_total
    rem = torch.minimum(rem.clamp(min=0.0), torch.nextafter(inner_total, torch.zeros_like(inner_total)))
    j = torch.searchsorted(inner, rem[:, None], right=True)[:, 0].clamp(max=chunk - 1)
    # NOTE: a row with no mass (every token masked) or a non-finite one has no token to draw: token 0,
    # so the step (and every other request in it) goes on
    return torch.where((total > 0) & torch.isfinite(total), c * chunk + j, 0)

