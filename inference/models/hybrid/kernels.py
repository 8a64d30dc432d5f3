"""The Mamba2 layer on CUDA through the `mamba-ssm` and `causal-conv1d` kernels, when installed.

Same interface and state layout as `mamba2.mamba2_layer` (the torch path, which stays the
reference): decode tokens go through `selective_state_update` and `causal_conv1d_update` reading
and writing the pool rows in place (`state_batch_indices` / `conv_state_indices`); prefill chunks
through `mamba_chunk_scan_combined` with the request's state as initial state. The packages are
imported only when a CUDA model asks for them (`pip install ".[mamba]"`).

NOTE: written against mamba-ssm 2.2 / causal-conv1d 1.5; exercised only by the `gpu`-marked
test (`tests/inference/models/hybrid/test_kernels.py`), which compares it with the torch path.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from inference.models.hybrid.mamba2 import Mamba2Dims, Mamba2Weights, conv_prefill, gate_norm

logger = logging.getLogger(__name__)


def available(device: torch.device) -> bool:
    """CUDA device and both packages importable (found, not imported)."""
    return (torch.device(device).type == "cuda" and importlib.util.find_spec("mamba_ssm") is not None
            and importlib.util.find_spec("causal_conv1d") is not None)


def select(device: torch.device, dtype: torch.dtype) -> Optional[Mamba2Kernels]:
    """The kernels for a model on `device`, or None (the torch path)."""
    if not available(device) or dtype == torch.float32:  # NOTE: the kernels target bf16 / fp16
        return None
    try:
        return Mamba2Kernels()
    except ImportError as exc:  # found but broken (e.g. built for another torch): say so, use torch
        logger.warning("mamba-ssm / causal-conv1d found but not importable (%s); using the torch Mamba2 path", exc)
        return None


class Mamba2Kernels:
    """The CUDA Mamba2 layer (see module docstring)."""

    def __init__(self) -> None:
        from causal_conv1d import causal_conv1d_update
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        self.conv_update = causal_conv1d_update
        self.state_update = selective_state_update
        self.chunk_scan = mamba_chunk_scan_combined

    def layer(self, hidden: torch.Tensor, w: Mamba2Weights, dims: Mamba2Dims, conv_states: torch.Tensor,
              ssm_states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, bounds: list[int],
              num_decode: int, proj_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        dtype = hidden.dtype
        if dims.in_multiplier != 1.0:
            hidden = hidden * dims.in_multiplier
        proj = F.linear(hidden, w.in_w, w.in_b)
        if proj_scale is not None:
            proj = proj * proj_scale
        inter, gs, nh, hd = dims.intermediate, dims.n_groups * dims.state_size, dims.num_heads, dims.head_dim
        z, xbc, dt = proj.split((inter, dims.conv_dim, nh), dim=-1)
        A = -torch.exp(w.A_log.float())
        y = torch.empty(hidden.shape[0], inter, dtype=dtype, device=hidden.device)
        if num_decode:
            rows = slots[:num_decode].to(torch.int32)
            stale = fresh[:num_decode]
            if bool(stale.any()):  # NOTE: decode rows are never fresh in the engine; zero them to be safe
                conv_states[slots[:num_decode][stale]] = 0
                ssm_states[slots[:num_decode][stale]] = 0
            xbc_d = self.conv_update(xbc[:num_decode].contiguous(), conv_states, w.conv_w, w.conv_b, "silu",
                                     conv_state_indices=rows)
            x, B, C = xbc_d.split((inter, gs, gs), dim=-1)
            n = num_decode
            y_d = self.state_update(
                ssm_states, x.reshape(n, nh, hd), dt[:num_decode, :, None].expand(n, nh, hd),
                A[:, None, None].expand(nh, hd, dims.state_size), B.reshape(n, dims.n_groups, -1),
                C.reshape(n, dims.n_groups, -1), w.D[:, None].expand(nh, hd), dt_bias=w.dt_bias[:, None].expand(nh, hd),
                dt_softplus=True, state_batch_indices=rows)
            y[:num_decode] = y_d.reshape(n, inter)
        slot_list, fresh_list = slots.tolist(), fresh.tolist()
        for r in range(num_decode, len(bounds) - 1):
            lo, hi, slot = bounds[r], bounds[r + 1], slot_list[r]
            xbc_r, window = conv_prefill(xbc[lo:hi], None if fresh_list[r] else conv_states[slot], w.conv_w,
                                         w.conv_b)
            conv_states[slot] = window
            x, B, C = xbc_r.split((inter, gs, gs), dim=-1)
            t = hi - lo
            out, final = self.chunk_scan(
                x.reshape(1, t, nh, hd), dt[lo:hi].unsqueeze(0), A, B.reshape(1, t, dims.n_groups, -1),
                C.reshape(1, t, dims.n_groups, -1), dims.chunk_size, D=w.D, dt_bias=w.dt_bias,
                initial_states=None if fresh_list[r] else ssm_states[slot].unsqueeze(0), dt_softplus=True,
                dt_limit=(dims.dt_min, dims.dt_max), return_final_states=True)
            y[lo:hi] = out.reshape(t, inter)
            ssm_states[slot] = final[0].to(ssm_states.dtype)
        return F.linear(gate_norm(y.float(), z, w.norm_w, dims, dtype), w.out_w, w.out_b)
