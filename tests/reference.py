"""Float64 references: what the tests compare fp32 (and bf16) results with.

The rule: a numerical test compares against an exact or float64 reference, never against another
fp32 computation, whose rounding varies with the CPU (vector width, kernel blocking, torch's
ATEN_CPU_CAPABILITY, the build of our C kernels).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _NoFloat32(TorchFunctionMode):
    """Every fp32 an op asks for (`.float()`, `.to(torch.float32)`, `dtype=torch.float32`) becomes float64.

    NOTE: HF upcasts to fp32 on purpose in places (RMSNorm statistics, RoPE angles, router softmax,
    Mamba's state): in a `.double()` model those steps would still round to fp32, which measured up
    to 4e-6 on tiny models' logits, as much as the whole fp32 forward's error.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        elif func is torch.Tensor.to:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_everywhere() -> Iterator[None]:
    """Within the block, code that asks for fp32 (ours or HF's) computes in float64 instead."""
    with _NoFloat32():
        yield


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of an HF model that computes in float64 throughout, with the same weights exactly
    (any float dtype widens losslessly). `model` itself is left as it was.

    NOTE: HF's grouped_mm experts take no float64; its eager loop over experts computes the same
    sums. Buffers computed at construction (RoPE's inverse frequencies) keep their fp32 values:
    they define the model, as they do for the engine, which takes them from the same formula.
    """
    reference = copy.deepcopy(model).double().eval()
    if getattr(reference.config, "_experts_implementation", "eager") != "eager":
        reference.set_experts_implementation("eager")
    forward = reference.forward

    @functools.wraps(forward)  # NOTE: HF's generate reads forward's signature
    def forward_in_float64(*args, **kwargs):
        with float64_everywhere():
            return forward(*args, **kwargs)

    reference.forward = forward_in_float64
    return reference


@torch.no_grad()
def reference_logprobs(reference: torch.nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """float64 `[len(generated)]`: the log-prob of each generated token under `reference` (a
    `float64_copy`), run once over the whole sequence."""
    logits = reference(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(generated)[:, None])[:, 0]


def max_logprob_error(reference: torch.nn.Module, outputs) -> float:
    """Largest |engine - reference| log-prob over every generated token of `outputs` (engine
    `RequestOutput`s)."""
    return max(((reference_logprobs(reference, o.prompt_token_ids, o.generated_token_ids)
                 - torch.tensor(o.logprobs, dtype=torch.float64)).abs().max().item() for o in outputs), default=0.0)
