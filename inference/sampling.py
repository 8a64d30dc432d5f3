"""Vectorised sampler over `[R, V]` logits: temperature, top-k, top-p, min-p, seeds, log-probs.

Per row, with x = the row's logits in float32 and T its temperature (T = 1 for greedy rows):
  1. z = x / T.
  2. top-k: keep tokens with x >= the k-th largest x (ties at the boundary are all kept).
  3. top-p: over the top-k survivors, renormalised, keep token i when the mass of the tokens
     strictly more likely than i is < p: the smallest nucleus reaching p, boundary ties kept.
  4. min-p: keep tokens with prob >= min_p * max prob. Renormalising keeps ratios and the top
     token survives 2-3, so this is z_i >= max z + log(min_p) whatever came before.
Each step keeps an upper set of x, so the whole truncation is one per-row threshold: keep x >= thr.
Greedy rows (T = 0) take argmax(x); truncation never removes the argmax, so the order is moot there.

Random rows sample by inverse CDF from one float64 uniform per row, in two levels (chunk of
`_CHUNK` tokens, then the token inside it) so the cumulative sums are short and float64-exact.
NOTE: chosen over the exponential race (argmax(p / Exp(1))), which needs V random numbers per
row; on CPU drawing them costs ~8x the softmax. A seeded row draws its uniform from its own
generator (exactly one draw per sampled token) and everything else it uses is computed within its
row, so its token depends only on its logits row and its generator, never on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference import sampling_kernel
from inference.sampling_params import LogprobsMode, SamplingParams
from inference.sampling_truncation import truncate

_CHUNK = 256  # tokens per first-level bucket of the inverse-CDF draw
_PROMPT_ROWS = 256  # rows per pass in compute_prompt_logprobs, bounding its float32 temporaries
_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters for one step, as tensors on the logits' device.

    Invariants: every tensor is `[R]`; `top_k <= 0` means off, `top_p == 1` off, `min_p == 0`
    off, `temperature == 0` greedy; `generators[i]` is row i's own generator (None: the global
    RNG); `logprobs_mode` is one mode for all rows or a `[R]` bool tensor (True = PROCESSED).
    `num_top_logprobs` is the top-n returned for every row (the max asked for in the batch).
    The `use_*` / `*_greedy` / `unit_temperature` flags are derived once, with one host sync, so
    the sampler can skip whole passes (the common RL step: T = 1, no truncation, raw log-probs).
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    generators: Sequence[torch.Generator | None]
    num_top_logprobs: int = 0
    logprobs_mode: LogprobsMode | Tensor = LogprobsMode.RAW
    use_top_k: bool = field(init=False)
    use_top_p: bool = field(init=False)
    use_min_p: bool = field(init=False)
    unit_temperature: bool = field(init=False)  # every row has T == 1 or is greedy
    any_greedy: bool = field(init=False)
    all_greedy: bool = field(init=False)
    need_raw: bool = field(init=False)
    need_processed: bool = field(init=False)

    def __post_init__(self) -> None:
        rows = self.temperature.shape[0]
        for name in ("temperature", "top_k", "top_p", "min_p"):
            if getattr(self, name).shape != (rows,):
                raise ValueError(f"{name} must have shape [{rows}], got {tuple(getattr(self, name).shape)}")
        if len(self.generators) != rows:
            raise ValueError(f"generators must have {rows} entries, got {len(self.generators)}")
        if self.num_top_logprobs < 0:
            raise ValueError(f"num_top_logprobs must be >= 0, got {self.num_top_logprobs}")
        t = self.temperature
        processed = self.logprobs_mode if isinstance(self.logprobs_mode, Tensor) else None
        checks = [(self.top_k > 0).any(), (self.top_p < 1).any(), (self.min_p > 0).any(),
                  ((t == 1) | (t == 0)).all(), (t == 0).any(), (t == 0).all()]
        if processed is not None:
            if processed.shape != (rows,) or processed.dtype != torch.bool:
                raise ValueError(f"logprobs_mode must be a LogprobsMode or a [{rows}] bool tensor")
            checks += [(~processed).any(), processed.any()]
        flags = torch.stack(checks).tolist() if rows else [False, False, False, True, False, True, True, False]
        (self.use_top_k, self.use_top_p, self.use_min_p, self.unit_temperature,
         self.any_greedy, self.all_greedy) = flags[:6]
        if processed is None:
            self.need_raw = self.logprobs_mode == LogprobsMode.RAW
            self.need_processed = not self.need_raw
        else:
            self.need_raw, self.need_processed = flags[6:] if rows else (True, False)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str | None = None,
                    generators: Sequence[torch.Generator | None] | None = None) -> SamplingBatch:
        """One row per `SamplingParams`. Without `generators`, a seeded row gets a fresh
        generator from its seed (so equal seeds sample equal tokens); pass your own to continue a
        sequence across steps or to give each of a request's n samples its own stream."""
        if generators is None:
            generators = [None if p.seed is None else make_generator(p.seed, device) for p in params]
        modes = {p.logprobs_mode for p in params} or {LogprobsMode.RAW}
        mode = modes.pop() if len(modes) == 1 else torch.tensor(
            [p.logprobs_mode == LogprobsMode.PROCESSED for p in params], dtype=torch.bool, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor([p.temperature for p in params], **f32),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], **f32),
            min_p=torch.tensor([p.min_p for p in params], **f32),
            generators=list(generators),
            num_top_logprobs=max((p.logprobs or 0 for p in params), default=0),
            logprobs_mode=mode,
        )


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
    """Raw log-probs of each prompt position's next token: `logprobs [P]`, top-n `[P, n]` or None."""

    logprobs: Tensor
    top_logprobs: Tensor | None
    top_token_ids: Tensor | None


def make_generator(seed: int, device: torch.device | str | None = None) -> torch.Generator:
    """A generator for one seeded row, on the device its uniforms are drawn on."""
    return torch.Generator(device=device or "cpu").manual_seed(seed)


_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The 64-bit seed of sample `index` of a request seeded `seed` (a splitmix64-style mix).

    NOTE: `seed + index` would make sample 1 of seed s replay sample 0 of seed s + 1; mixing both
    inputs through the finaliser makes nearby (seed, index) pairs give unrelated streams.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """`sample` with a float32 workspace kept across steps (grown on demand, never shrunk).

    NOTE: on CPU a fresh `[R, V]` float32 buffer per step costs page faults on the order of the
    exp pass itself, so the engine holds one of these; `release()` frees it (engine suspend).
    """

    __slots__ = ("_workspace",)

    def __init__(self) -> None:
        self._workspace: Tensor | None = None

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        need = _workspace_numel(logits)
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
    if workspace is None:
        workspace = torch.empty(_workspace_numel(logits), dtype=torch.float32, device=logits.device)
    x = logits
    if x.dtype != torch.float32:
        # NOTE: one float32 copy is cheaper than the mixed-dtype ops (sub, compare, argmax) it saves.
        x = workspace[rows * padded: rows * (padded + vocab)].view(rows, vocab).copy_(logits)
    t = batch.temperature
    inv_t = torch.where(t == 0, torch.ones_like(t), t).reciprocal()
    truncating = batch.use_top_k or batch.use_top_p or batch.use_min_p
    w_full = workspace[: rows * padded].view(rows, padded)
    w = w_full[:, :vocab]
    thr = None
    raw_log_norm = None  # log sum exp(x - max x), for RAW log-probs
    if not truncating and not batch.all_greedy and sampling_kernel.usable(x):
        # NOTE: the native path draws from the same uniforms by the same inverse CDF (sampling_kernel.py)
        token_ids, m, total, raw_total = sampling_kernel.sample_rows(
            x, inv_t, _uniforms(rows, batch.generators, x.device), raw=batch.need_raw)
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
        if batch.need_raw and batch.unit_temperature and truncating:
            raw_log_norm = w.sum(-1).log()  # w is still exp(x - m): reuse it before it is cut
        thr = truncate(x, w, m, inv_t, batch) if truncating else None
        chunk_sums = w_full.view(rows, n_chunks, chunk).sum(-1).double()
        cdf = chunk_sums.cumsum(-1)
        total = cdf[:, -1]
        u = _uniforms(rows, batch.generators, x.device)
        if batch.all_greedy:
            token_ids = x.argmax(-1)
        else:
            token_ids = _inverse_cdf(w_full.view(rows, n_chunks, chunk), chunk_sums, cdf, total, u)
    if batch.any_greedy and not batch.all_greedy:
        token_ids = torch.where(t == 0, x.argmax(-1), token_ids)
    log_total = total.log().float()  # log normaliser of the processed distribution, in z units
    if batch.need_raw and raw_log_norm is None:
        # w is spent once the tokens are drawn; reuse its storage for exp(x - m).
        raw_log_norm = log_total if batch.unit_temperature else torch.sub(x, m[:, None], out=w).exp_().sum(-1).log()
    x_tok = x.gather(1, token_ids[:, None])[:, 0]
    logprobs = _select(batch, lambda: x_tok - m - raw_log_norm,
                       lambda: (x_tok - m) * inv_t - log_total)
    n = min(batch.num_top_logprobs, vocab)
    if n == 0:
        return SamplerOutput(token_ids, logprobs, None, None)
    # NOTE: x and z = x / T order tokens alike, and the kept set is an upper set of x, so one
    # top-n of x serves both modes; only the values differ.
    top_x, top_ids = x.topk(n, dim=-1)

    def processed_top() -> Tensor:
        top = (top_x - m[:, None]) * inv_t[:, None] - log_total[:, None]
        return top if thr is None else top.masked_fill_(top_x < thr[:, None], _NEG_INF)

    top = _select(batch, lambda: top_x - (m + raw_log_norm)[:, None], processed_top)
    return SamplerOutput(token_ids, logprobs, top, top_ids)


def compute_prompt_logprobs(logits: Tensor, target_ids: Tensor, num_top: int = 0) -> PromptLogprobs:
    """Raw log-probs of `target_ids [P]` under `logits [P, V]` (row i predicts target i), plus
    the top-`num_top` alternatives. Works on `_PROMPT_ROWS` rows at a time to bound memory."""
    n = min(num_top, logits.shape[-1])
    lps, tops, ids = [], [], []
    for start in range(0, logits.shape[0], _PROMPT_ROWS):
        x = logits[start:start + _PROMPT_ROWS]
        m = x.amax(-1, keepdim=True).float()
        log_z = m + torch.sub(x, m).exp_().sum(-1, keepdim=True).log()
        lps.append((x.gather(1, target_ids[start:start + _PROMPT_ROWS, None]).float() - log_z)[:, 0])
        if n:
            top_x, top_ids = x.topk(n, dim=-1)
            tops.append(top_x.float() - log_z)
            ids.append(top_ids)
    if not lps:  # no prompt rows: keep the shapes' trailing dims
        lps, tops, ids = [logits.new_empty(0).float()], [logits.new_empty(0, n).float()], [target_ids.new_empty(0, n)]
    return PromptLogprobs(torch.cat(lps), torch.cat(tops) if n else None, torch.cat(ids) if n else None)


def _workspace_numel(logits: Tensor) -> int:
    """Float32 elements `sample` needs: the padded weights, plus a float32 copy of other dtypes."""
    rows, vocab = logits.shape
    return rows * (_padded(vocab) + (0 if logits.dtype == torch.float32 else vocab))


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
    c = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    before = torch.where(c > 0, cdf[idx, (c - 1).clamp(min=0)], 0.0)
    inner = w3[idx, c].double().cumsum(-1)
    inner_total = inner[:, -1]
    # Rescale the residual from the float32 chunk sum to this float64 cumsum of the same chunk.
    rem = (target - before) / chunk_sums[idx, c] * inner_total
    rem = torch.minimum(rem.clamp(min=0.0), torch.nextafter(inner_total, torch.zeros_like(inner_total)))
    j = torch.searchsorted(inner, rem[:, None], right=True)[:, 0]
    return c * chunk + j

