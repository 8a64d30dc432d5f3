"""An expert-parallel rank's step: agree on the batch shape with the peers, then run it (or a dummy).

Every rank of an EP group runs every step together: the MoE layers' all-to-alls need all of them,
and with CUDA graphs all must replay the same padded bucket. So each step starts with one CPU-side
agreement over ZMQ (`EPCommunicator.sync_all_reduce_max`) of `[tokens, requests, prefill,
unfinished, leaving]`: the MAX gives the bucket every rank pads to (`BucketPolicy.match`, megatron-core's
`match_graph_config`) and tells whether anyone has work at all.

* A rank whose scheduler planned nothing runs a dummy batch of the agreed shape: one-token requests
  in the scratch KV block (`ModelRunner.prepare_dummy`, megatron's
  `add_dummy_requests_for_expert_parallel_step`). It allocates no block and touches no request, so
  idle dummy steps leave the prefix cache as it was (megatron resets its context with
  `preserve_prefix_cache=True` for the same reason).
* A rank keeps stepping while any rank has unfinished requests; when none has, the round was the
  group's last (`all_idle`) and every rank stops together. Idle ranks still agree every
  `heartbeat_s` (so a peer with new work is answered within that), and a peer that disappears
  makes the agreement fail with `EPPeerLostError` within the communicator's timeout.
* The group ends together: a rank that `leave()`s says so in its next round; that round is
  every rank's last (`stopped`), so no rank is left waiting for a peer that quit. A failed step
  (a lost peer, a failed exchange) also ends the lockstep on this rank: the group is broken.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Optional

from inference.config import PauseMode
from inference.core.states import EngineState
from inference.runner.buckets import IDLE, BatchDims
from inference.sched.scheduler import StepPlan

BUCKET_HISTORY = 1 << 14  # steps whose agreed bucket is kept (for checks and stats)


class ExpertParallelSteps:
    """Drives one EP rank's `EngineCore` in lockstep with its peers (see module docstring).

    Invariant: each `step()` makes exactly one agreement round (none once `stopped`), so ranks
    stay in step. `core` is
    the rank's `EngineCore` (not imported here: the core imports this module).
    """

    def __init__(self, core: Any, communicator: Any, *, heartbeat_s: float = 0.01) -> None:
        self.core = core
        self.comm = communicator
        self.heartbeat_s = heartbeat_s
        self.all_idle = False  # the last round: no rank had an unfinished request
        self.peers_busy = False  # the last round: some rank had work
        self.leaving = False  # this rank asked the group to stop (`leave`)
        self.stopped = False  # no more rounds: the group stopped, or a step failed (group broken)
        self.rounds = 0
        self.dummy_steps = 0
        self.buckets: deque[tuple[int, Optional[int]]] = deque(maxlen=BUCKET_HISTORY)  # (round, bucket)
        self._last_round = 0.0

    def _may_schedule(self) -> bool:
        core = self.core
        if core.weights.serving_error is not None:
            return False
        return core.state is EngineState.RUNNING or (
            core.state is EngineState.PAUSED and core.pause_mode is PauseMode.WAIT and core.scheduler.in_flight())

    def leave(self) -> None:
        """Ask the group to stop after the next round (every rank's last); see `stopped`."""
        self.leaving = True

    def wants_step(self) -> bool:
        """Whether the rank should step now: it has work, a peer had, it is leaving, or a
        heartbeat is due."""
        if self.stopped:
            return False
        if self.leaving:
            return True
        if self.core.state is EngineState.SUSPENDED:
            return False
        local = self._may_schedule() and self.core.scheduler.has_unfinished_requests()
        return local or self.peers_busy or not self.all_idle or \
            time.monotonic() - self._last_round >= self.heartbeat_s

    def step(self) -> None:
        if self.stopped:
            return
        try:
            self._step()
        except BaseException:
            self.stopped = True  # NOTE: peers wait on this rank's next round in vain: fail, don't hang
            self.comm.close()
            raise

    def _step(self) -> None:
        core, runner = self.core, self.core.runner
        plan: Optional[StepPlan] = None
        if self._may_schedule() and core.scheduler.has_unfinished_requests():
            plan = core.scheduler.schedule(admit_new=core.state is EngineState.RUNNING)
        local = IDLE if plan is None or plan.empty else runner.local_dims(plan)
        unfinished = int(core.scheduler.has_unfinished_requests())
        agreed = self.comm.sync_all_reduce_max([*local.to_list(), unfinished, int(self.leaving)])
        self._last_round = time.monotonic()
        self.rounds += 1
        dims = BatchDims.from_list(agreed[:3])
        self.all_idle = agreed[3] == 0
        self.peers_busy = not dims.idle
        if agreed[4]:  # NOTE: this round still runs (its plan is scheduled), then no more
            self.stopped = True
            self.comm.close()
        if dims.idle:
            return
        self.buckets.append((self.rounds, runner.match_bucket(dims)))
        if local.idle:
            runner.forward(runner.prepare_dummy(dims))
            self.dummy_steps += 1
            return
        core.run_plan(plan, runner.prepare(core.context, plan, dims))

    def stats(self) -> dict:
        return {"ep_rank": self.comm.rank, "ep_size": self.comm.world_size, "ep_rounds": self.rounds,
                "ep_dummy_steps": self.dummy_steps, "ep_stopped": self.stopped}
