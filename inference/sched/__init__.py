"""What runs each step: the per-slot bookkeeping of requests in flight and the scheduler over it."""

from inference.sched.context import DynamicInferenceContext
from inference.sched.scheduler import Scheduler, StepPlan

__all__ = ["DynamicInferenceContext", "Scheduler", "StepPlan"]
