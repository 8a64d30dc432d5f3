"""The per-row sampling tensors of one step, gathered from each row's `SamplingParams`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference.sampling.params import LogprobsMode, SamplingParams
from inference.sampling.processors import StepProcessors
from inference.sampling.seeds import make_generator


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters for one step, as tensors on the logits' device.

    Invariants: every tensor is `[R]`; `top_k <= 0` means off, `top_p == 1` off, `min_p == 0`
    off, `temperature == 0` greedy; `generators[i]` is row i's own generator (None: the global
    RNG); `logprobs_mode` is one mode for all rows or a `[R]` bool tensor (True = PROCESSED).
    `num_top_logprobs` is the top-n returned for every row (the max asked for in the batch).
    `processors`: the step's logit processors (processors.py), None when no row uses one.
    `uniforms`: preset random numbers of the rows' inverse-CDF draws (the exact-distribution tests
    sweep them); None draws one per row from its generator.
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
    processors: StepProcessors | None = None
    uniforms: Tensor | None = None  # [R] float64 in [0, 1): each row's uniform, preset (None: drawn)
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
        if self.uniforms is not None and self.uniforms.shape != (rows,):
            raise ValueError(f"uniforms must have shape [{rows}], got {tuple(self.uniforms.shape)}")
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
