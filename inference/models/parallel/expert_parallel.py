"""Where an MoE layer's (token, expert) pairs are computed: here, or on the rank that owns the expert.

With expert parallelism over `W` ranks, rank `r` holds experts `[r * n, (r + 1) * n)`, `n = E / W`,
and every rank routes its own tokens over all `E` experts (the router is replicated). A layer then
*dispatches* each (token, choice) pair's hidden row to the owner of its expert with
`torch.distributed.all_to_all_single` (gloo on CPU, NCCL on GPU), the owner runs its experts over
everything it received, and the outputs travel back the same way (*combine*); the caller weights
and sums them (`moe/layer.py: combine`). Every rank must call every layer's exchange in the same order, so
every rank runs every step (see `inference/core/ep_sync.py`): a rank with no work runs a dummy batch.

Two exchanges:
* variable (eager): rows are sorted by expert (so by destination) and sent with exact split sizes
  (a first all-to-all of the counts per expert, from which the owner knows each row's expert);
  the owner sorts what it received by expert and runs each expert over its rows
  (`ExpertWeights.sparse`). Host syncs on the counts.
* static (CUDA-graph capture): every rank sends each peer a fixed `T * k` slots (empty ones marked
  with expert -1) and experts run masked (`ExpertWeights.masked`): fixed shapes, no host sync.
  All ranks must then have the same `T`, which the padded-bucket agreement guarantees.
`LocalDispatch` (`models/moe/dispatch.py`) is the single-process case (no collective), with the same two
paths.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from inference.models.moe.layer import ExpertWeights


class ExpertParallelError(RuntimeError):
    """An expert-parallel collective failed: a peer is gone, or it did not arrive in time."""


class ExpertParallel:
    """This rank's share of the experts and the all-to-all exchanges over its process group.

    Invariant: every rank of `group` calls `run` the same number of times in the same order (one
    call per MoE layer per step); with `static=True`, with the same number of tokens.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallel needs torch.distributed initialised (init_process_group)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if num_experts % self.world_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.world_size} EP ranks")
        self.num_experts = num_experts
        self.num_local = num_experts // self.world_size
        self.first_expert = self.rank * self.num_local

    def __repr__(self) -> str:
        return (f"ExpertParallel(rank {self.rank} of {self.world_size}, experts [{self.first_expert}, "
                f"{self.first_expert + self.num_local}) of {self.num_experts})")

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except RuntimeError as exc:  # NOTE: gloo raises RuntimeError for a closed peer and for its timeout
            raise ExpertParallelError(
                f"expert-parallel all-to-all failed on EP rank {self.rank} of {self.world_size} "
                f"(a peer is gone or timed out): {exc}") from exc

    def run(self, h: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights, *, static: bool = False) -> torch.Tensor:
        """Expert outputs `[T * k, H]` of every (token, choice) pair, in (token, choice) order."""
        if experts.num_local != self.num_local:
            raise ValueError(f"{experts.num_local} local experts given, this rank holds {self.num_local}")
        return self._static(h, ids, experts) if static else self._variable(h, ids, experts)

    def _variable(self, h: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        k, width, n, world = ids.shape[1], h.shape[1], self.num_local, self.world_size
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by owner rank, then by its local expert
        # NOTE: counts per (owner, local expert): the owner rebuilds each row's expert from them,
        # so only the rows travel (3 exchanges per layer, not 4)
        send_counts = torch.bincount(flat, minlength=self.num_experts)
        recv_counts = torch.empty_like(send_counts)
        self._all_to_all(recv_counts, send_counts)
        sends = send_counts.view(world, n).sum(1).tolist()
        per_expert = recv_counts.tolist()  # [source rank * n + local expert]
        recvs = [sum(per_expert[r * n : (r + 1) * n]) for r in range(world)]
        received = h.new_empty(sum(recvs), width)
        self._all_to_all(received, h.index_select(0, order // k), recvs, sends)
        local = torch.arange(n, device=h.device).repeat(world).repeat_interleave(recv_counts)
        # what arrived is grouped by source rank: run each local expert once over all its rows
        by_expert = torch.argsort(local, stable=True)
        counts = recv_counts.view(world, n).sum(0).tolist()
        outputs = torch.empty_like(received)
        outputs[by_expert] = experts.sparse(received.index_select(0, by_expert), counts)
        back = h.new_empty(flat.numel(), width)
        self._all_to_all(back, outputs, sends, recvs)
        out = torch.empty_like(back)
        out[order] = back
        return out

    def _static(self, h: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        k, width, n, world = ids.shape[1], h.shape[1], self.num_local, self.world_size
        flat = ids.reshape(-1)
        pairs = flat.numel()  # NOTE: the capacity per peer: all of this rank's pairs may go to one
        dest = flat // n
        order = torch.argsort(dest, stable=True)
        counts = torch.zeros(world, dtype=torch.int64, device=h.device).scatter_add_(0, dest, torch.ones_like(dest))
        starts = torch.cumsum(counts, 0) - counts
        sorted_dest = dest[order]
        slot = sorted_dest * pairs + torch.arange(pairs, device=h.device) - starts[sorted_dest]
        send = h.new_zeros(world * pairs, width)
        send.index_copy_(0, slot, h.index_select(0, order // k))
        send_ids = torch.full((world * pairs,), -1, dtype=torch.int64, device=h.device)
        send_ids.index_copy_(0, slot, (flat - dest * n)[order])
        received, received_ids = torch.empty_like(send), torch.empty_like(send_ids)
        self._all_to_all(received, send)
        self._all_to_all(received_ids, send_ids)
        outputs = experts.masked(received, received_ids)
        back = torch.empty_like(outputs)
        self._all_to_all(back, outputs)
        out = h.new_empty(pairs, width)
        out[order] = back.index_select(0, slot)
        return out
