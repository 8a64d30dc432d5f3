"""The engine core: its parts, its state machine, its step, and the loop that drives it."""

from inference.core.engine_core import EngineCore
from inference.core.memory import SuspendReport
from inference.core.states import EngineState

__all__ = ["EngineCore", "EngineState", "SuspendReport"]
