"""The Mamba2 mixer as functions over weight tensors, for a flat batch of requests.

Per token: `in_proj` gives the gate `z`, the convolved stream `xBC` and the step sizes `dt`; a
depthwise causal conv1d (kernel `K`, SiLU) runs over `xBC`, which splits into `x` (heads x
head_dim), `B` and `C` (groups x state); then per head the selective state space recurrence

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t,      y_t = C_t . h_t + D * x_t

and a gated RMSNorm of `y` with `z` before `out_proj`. A request's state between steps is its
conv window (the last `K - 1` inputs of `xBC`, `[conv_dim, K - 1]`) and its SSM state
(`[heads, head_dim, state]`, kept in fp32), both in the engine's state pool.

Prefill chunks run the chunked SSD form (quadratic inside a chunk of `chunk` tokens, recurrent
across chunks); decode tokens run the one-step recurrence, vectorised over the batch. As in the
reference implementation (mamba_ssm, HF), `time_step_limit` clamps `dt` in prefill only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from inference.models.packed_weights import linear  # NOTE: F.linear, bf16 on CPU through a pack (same bits)


class GateNorm(enum.Enum):
    """How `y` meets the gate `z` before `out_proj` (RMSNorm statistics per group of channels)."""

    GATE_THEN_NORM = "gate_then_norm"  # Bamba, Nemotron-H: norm(y * silu(z)) * w
    NORM_THEN_GATE = "norm_then_gate"  # Falcon-H1 with mamba_norm_before_gate: norm(y) * w * silu(z)
    GATE_ONLY = "gate_only"  # Falcon-H1 without mamba_rms_norm: y * silu(z)


@dataclass(frozen=True, slots=True)
class Mamba2Dims:
    """Sizes and constants of one model's Mamba2 layers (all its Mamba layers share them)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int = 64
    dt_min: float = 0.0
    dt_max: float = float("inf")
    gate_norm: GateNorm = GateNorm.GATE_THEN_NORM
    norm_eps: float = 1e-5
    in_multiplier: float = 1.0  # Falcon-H1 ssm_in_multiplier
    # Falcon-H1's per-section multipliers of in_proj's output (z, x, B, C, dt); None: all ones
    proj_multipliers: Optional[tuple[float, float, float, float, float]] = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Mamba2Dims.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba2Dims.num_heads ({self.num_heads}) must be a multiple of n_groups "
                             f"({self.n_groups})")
        if self.conv_kernel < 2:
            raise ValueError(f"Mamba2Dims.conv_kernel must be >= 2, got {self.conv_kernel}")

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size

    @property
    def proj_dim(self) -> int:
        return self.intermediate + self.conv_dim + self.num_heads

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    def proj_scale(self, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """The `[proj_dim]` multiplier vector of in_proj's output, or None when it is all ones."""
        if self.proj_multipliers is None or all(m == 1.0 for m in self.proj_multipliers):
            return None
        gs = self.n_groups * self.state_size
        sizes = (self.intermediate, self.intermediate, gs, gs, self.num_heads)
        return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, self.proj_multipliers)]).to(device, dtype)


class Mamba2Weights:
    """One Mamba2 layer's tensors (views of the model's HF-named tensors, never copies)."""

    __slots__ = ("in_w", "in_b", "conv_w", "conv_b", "dt_bias", "A_log", "D", "norm_w", "out_w", "out_b")

    def __init__(self, in_w, in_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_w, out_b) -> None:
        self.in_w, self.in_b = in_w, in_b
        self.conv_w = conv_w.squeeze(1) if conv_w.dim() == 3 else conv_w  # HF's [C, 1, K] -> [C, K], a view
        self.conv_b = conv_b
        self.dt_bias, self.A_log, self.D = dt_bias, A_log, D
        self.norm_w = norm_w
        self.out_w, self.out_b = out_w, out_b


# ---- the pieces ------------------------------------------------------------------------------


def conv_prefill(x: torch.Tensor, window: Optional[torch.Tensor], w: torch.Tensor,
                 b: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d + SiLU of one request's chunk `x [T, C]` after its `window`
    (`[C, K - 1]`, the previous inputs; None: zeros). Returns `(y [T, C], new window)`."""
    k = w.shape[1]
    xt = x.t()
    full = F.pad(xt, (k - 1, 0)) if window is None else torch.cat((window.to(x.dtype), xt), dim=1)
    y = F.conv1d(full.unsqueeze(0), w.unsqueeze(1), b, groups=w.shape[0])[0]
    return F.silu(y).t(), full[:, full.shape[1] - (k - 1):]


def conv_decode(x: torch.Tensor, windows: torch.Tensor, w: torch.Tensor,
                b: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: `x [B, C]` after `windows [B, C, K - 1]`; `(y [B, C], new windows)`."""
    full = torch.cat((windows.to(x.dtype), x.unsqueeze(2)), dim=2)
    y = (full * w).sum(dim=2)
    if b is not None:
        y = y + b
    return F.silu(y), full[:, :, 1:]


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """`a [..., Q]` -> `[..., Q, Q]` with entry `(t, s) = a[s+1] + ... + a[t]` for `s <= t`, -inf above.

    Summed from a masked matrix rather than as a difference of cumulative sums, which would lose
    the small recent terms against a large running total.
    """
    q = a.shape[-1]
    rows = a.unsqueeze(-1).expand(*a.shape, q)  # (t, s) = a[t]
    below = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    sums = rows.masked_fill(~below, 0.0).cumsum(dim=-2)
    return sums.masked_fill(~below.logical_or(torch.eye(q, dtype=torch.bool, device=a.device)), float("-inf"))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, h0: Optional[torch.Tensor], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's chunk through the SSM, in fp32. `x [T, H, P]`, `dt [T, H]` (discretised),
    `A [H]` (negative), `B`, `C` `[T, G, N]`, `D [H]`, `h0 [H, P, N]` or None (zeros).

    Returns `(y [T, H, P], h_T)`. Inside each chunk of `chunk` tokens the output is a masked
    product (the "dual" quadratic form); chunk-start states are carried by the recurrence.
    """
    t, h, p = x.shape
    g, n = B.shape[1:]
    Bh = B.repeat_interleave(h // g, dim=1)
    Ch = C.repeat_interleave(h // g, dim=1)
    a = dt * A  # [T, H], log of each step's decay (<= 0)
    xdt = x * dt.unsqueeze(-1)
    q = min(chunk, t)
    nc = -(-t // q)
    pad = nc * q - t
    if pad:  # padded steps decay nothing and add nothing
        a, xdt, Bh, Ch = (F.pad(v, (0, 0) * (v.dim() - 1) + (0, pad)) for v in (a, xdt, Bh, Ch))
    a = a.view(nc, q, h).transpose(1, 2)  # [c, H, Q]
    xdt, Bh, Ch = xdt.view(nc, q, h, p), Bh.view(nc, q, h, n), Ch.view(nc, q, h, n)

    decay = torch.exp(_segment_sums(a))  # [c, H, Q(t), Q(s)]
    scores = torch.einsum("cthn,cshn->chts", Ch, Bh) * decay
    y = torch.einsum("chts,cshp->cthp", scores, xdt)
    # what each chunk adds to the state, from a zero start; and its total decay
    to_end = decay[:, :, -1, :]  # [c, H, Q]: decay from step s to the chunk's end
    added = torch.einsum("chs,cshn,cshp->chpn", to_end, Bh, xdt)
    total = torch.exp(a.sum(dim=2))  # [c, H]
    state = torch.zeros(h, p, n, dtype=x.dtype, device=x.device) if h0 is None else h0.to(x.dtype)
    starts = []
    for c in range(nc):
        starts.append(state)
        state = state * total[c, :, None, None] + added[c]
    if nc > 1 or h0 is not None:
        from_start = torch.exp(a.cumsum(dim=2)).transpose(1, 2)  # [c, Q, H]: decay since the chunk start
        y = y + torch.einsum("cthn,chpn->cthp", Ch, torch.stack(starts)) * from_start.unsqueeze(-1)
    y = y.reshape(nc * q, h, p)[:t]
    return y + x * D[:, None], state


def ssm_advance(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                state: torch.Tensor) -> torch.Tensor:
    """The state half of `ssm_step`: `state [R, H, P, N]` advanced in place by one token per row;
    returns it as `[R * H, P, N]`. Speculative verify steps replay it over the tokens they keep
    (`hybrid/verify.py`), so one function keeps the two bit-identical."""
    r, h, p = x.shape
    g, n = B.shape[1:]
    Bh = B.repeat_interleave(h // g, dim=1).reshape(r * h, 1, n)
    flat = state.view(r * h, p, n)
    flat.mul_(torch.exp(dt * A).reshape(r * h, 1, 1))
    flat.baddbmm_((x * dt.unsqueeze(-1)).reshape(r * h, p, 1), Bh)
    return flat


def ssm_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request, in fp32: `x [R, H, P]`, `dt [R, H]`, `B`, `C` `[R, G, N]`,
    `state [R, H, P, N]`, which is updated in place and returned. Returns `(y [R, H, P], state)`.

    NOTE: the state is the largest tensor of a decode step; each op here passes over it once.
    """
    r, h, p = x.shape
    g, n = C.shape[1:]
    flat = ssm_advance(x, dt, A, B, state)
    Ch = C.repeat_interleave(h // g, dim=1).reshape(r * h, 1, n)
    y = (flat * Ch).sum(-1).view(r, h, p)  # NOTE: ~3x a batched matrix-vector bmm on CPU
    return y + x * D[:, None], state


def gate_norm(y: torch.Tensor, z: torch.Tensor, weight: Optional[torch.Tensor], dims: Mamba2Dims,
              dtype: torch.dtype) -> torch.Tensor:
    """`y [T, I]` (fp32) gated by `z [T, I]`, normalised per group as `dims.gate_norm` says."""
    gate = F.silu(z.float())
    if dims.gate_norm is GateNorm.GATE_ONLY:
        return (y * gate).to(dtype)
    if dims.gate_norm is GateNorm.GATE_THEN_NORM:
        y = y * gate
    t, i = y.shape
    grouped = y.view(t, dims.n_groups, i // dims.n_groups)
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + dims.norm_eps)).view(t, i)
    if dims.gate_norm is GateNorm.GATE_THEN_NORM:
        return weight * normed.to(dtype)
    return (weight.float() * normed * gate).to(dtype)


# ---- the layer over a flat batch -------------------------------------------------------------


def mamba2_layer(hidden: torch.Tensor, w: Mamba2Weights, dims: Mamba2Dims, conv_states: torch.Tensor,
                 ssm_states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, bounds: list[int],
                 num_decode: int, proj_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mamba2 mixer over a flat batch `hidden [T, hidden]`; returns `[T, hidden]`.

    Request `r` owns rows `bounds[r]:bounds[r + 1]` and state rows `slots[r]` of `conv_states`
    (`[slots, C, K - 1]`) and `ssm_states` (`[slots, H, P, N]`, this layer's views of the pool),
    which it reads (zeros when `fresh[r]`) and writes back. Requests `[0, num_decode)` are decode
    steps (one token each, `bounds[r] == r`); the others are prefill chunks.
    """
    dtype = hidden.dtype
    inter, nh = dims.intermediate, dims.num_heads
    z, xbc, dt_all = in_projection(hidden, w, dims, proj_scale)
    A, D = ssm_constants(w)
    y = torch.empty(hidden.shape[0], nh, dims.head_dim, dtype=torch.float32, device=hidden.device)
    if num_decode:
        rows = slots[:num_decode]
        windows, states = conv_states.index_select(0, rows), ssm_states.index_select(0, rows).float()
        if bool(fresh[:num_decode].any()):  # NOTE: never in the engine (a decode follows a prefill)
            windows[fresh[:num_decode]] = 0
            states[fresh[:num_decode]] = 0
        xbc_dec, new_windows = conv_decode(xbc[:num_decode], windows, w.conv_w, w.conv_b)
        x, B, C = split_xbc(xbc_dec.float(), dims)
        y_dec, new_states = ssm_step(x, dt_all[:num_decode], A, B, C, D, states)
        y[:num_decode] = y_dec
        conv_states.index_copy_(0, rows, new_windows.to(conv_states.dtype))
        ssm_states.index_copy_(0, rows, new_states.to(ssm_states.dtype))
    if len(bounds) - 1 > num_decode:
        dt_pf = dt_all.clamp(dims.dt_min, dims.dt_max) if (dims.dt_min > 0 or dims.dt_max < float("inf")) else dt_all
        slot_list, fresh_list = slots.tolist(), fresh.tolist()
        for r in range(num_decode, len(bounds) - 1):
            lo, hi, slot = bounds[r], bounds[r + 1], slot_list[r]
            window = None if fresh_list[r] else conv_states[slot]
            xbc_r, new_window = conv_prefill(xbc[lo:hi], window, w.conv_w, w.conv_b)
            x, B, C = split_xbc(xbc_r.float(), dims)
            y_r, final = ssd_scan(x, dt_pf[lo:hi], A, B, C, D, None if fresh_list[r] else ssm_states[slot],
                                  dims.chunk_size)
            y[lo:hi] = y_r
            conv_states[slot] = new_window
            ssm_states[slot] = final
    out = gate_norm(y.view(hidden.shape[0], inter), z, w.norm_w, dims, dtype)
    return linear(out, w.out_w, w.out_b)


def in_projection(hidden: torch.Tensor, w: Mamba2Weights, dims: Mamba2Dims,
                  proj_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hidden [T, hidden]` -> the gate `z [T, I]`, the conv input `xBC [T, C]` (model dtype) and
    the discretised step sizes `dt [T, H]` (fp32, not clamped)."""
    if dims.in_multiplier != 1.0:
        hidden = hidden * dims.in_multiplier
    proj = linear(hidden, w.in_w, w.in_b)
    if proj_scale is not None:
        proj = proj * proj_scale
    z, xbc, dt_raw = proj.split((dims.intermediate, dims.conv_dim, dims.num_heads), dim=-1)
    return z, xbc, F.softplus(dt_raw.float() + w.dt_bias.float())


def ssm_constants(w: Mamba2Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """`(A, D)` in fp32: the (negative) decay rates and the skip weights, per head."""
    return -torch.exp(w.A_log.float()), w.D.float()


def split_xbc(xbc: torch.Tensor, dims: Mamba2Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gs = dims.n_groups * dims.state_size
    x, B, C = xbc.split((dims.intermediate, gs, gs), dim=-1)
    t = xbc.shape[0]
    return (x.reshape(t, dims.num_heads, dims.head_dim), B.reshape(t, dims.n_groups, dims.state_size),
            C.reshape(t, dims.n_groups, dims.state_size))
