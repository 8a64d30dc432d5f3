"""Staleness at the door: work started too many policy versions ago never reaches a prefill.

With `max_staleness = k`, a sample (or a session) whose start version is more than k versions
behind the current one is handled per `StalePolicy` as soon as the version moves, before the
next step re-prefills anything a pause, a retract or the update put back in line: ABORT finishes
it with reason `stale` (its tokens returned, marked as not to train on); RECOMPUTE starts it
again from its prompt under the current version (its tokens so far dropped). A sample that
streams its tokens cannot take back what it sent, so it is aborted under either policy.
A stale session under ABORT is refused from then on (`StaleSessionError`) until it ends; under
RECOMPUTE it starts again under the current version (its next turn prefills its whole prompt).
"""

from __future__ import annotations

from inference.config import StalePolicy
from inference.request import FinishReason, Request, RequestStatus
from inference.sampling.seeds import make_generator, sample_seed
from inference.sched.scheduler import Scheduler


def enforce_staleness(scheduler: Scheduler, max_staleness: int, policy: StalePolicy) -> tuple[list[Request], int]:
    """Handle every live sample and session started before `current - max_staleness`; returns
    (the samples finished `stale`, how many samples were restarted)."""
    current = scheduler.ctx.policy_version
    oldest = current - max_staleness
    salts = scheduler.salts
    for session_id in salts.sessions_before(oldest):
        if policy is StalePolicy.ABORT:
            scheduler.end_session(session_id)
            salts.mark_stale(session_id)
        else:
            salts.start_session(session_id, current)
    stale = sorted((r for r in scheduler.live.values() if r.start_version < oldest), key=lambda r: r.request_id)
    aborted: list[Request] = []
    restarted = 0
    for req in stale:
        if policy is StalePolicy.ABORT or req.stream_tokens:
            if scheduler.abort(req.request_id, FinishReason.STALE) is not None:
                aborted.append(req)
        else:
            _restart(scheduler, req, current)
            restarted += 1
    return aborted, restarted


def _restart(scheduler: Scheduler, req: Request, version: int) -> None:
    """Drop what `req` generated and queue it again, first in line, to start from its prompt."""
    ctx = scheduler.ctx
    if req.status in (RequestStatus.RUNNING, RequestStatus.PAUSED):
        ctx.release_memory_blocks_from_request_indexes([ctx.requests.index(req)])
        scheduler.requeue_released(req)
    req.generated_token_ids, req.logprobs, req.token_versions = [], [], []
    req.top_logprobs = None
    req.prompt_scores, req.prompt_logprobs, req.prompt_logprob_ranks = None, None, None
    req.first_token_time = None
    req.hash_cache_key = None
    if req.params.seed is not None:  # NOTE: the same draws as a fresh request of that seed
        req.generator = make_generator(sample_seed(req.params.seed, req.sample_index))
    scheduler.set_start_version(req, version)
