"""rollout-engine's inference engine: one model replica serving many requests at once."""

from inference.config import EvictionPolicy, InferenceConfig, InFlightPolicy, SuspendedAddPolicy
from inference.engine import DynamicInferenceEngine, EngineState
from inference.errors import (
    ActiveRequestCountOverflowError,
    BlockOverflowError,
    ContextErrorFactory,
    ContextOverflowError,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    TensorStateDeallocatedError,
    TokenOverflowError,
)
from inference.request import FinishReason, RequestOutput
from inference.sampling_params import LogprobsMode, SamplingParams

__all__ = [
    "ActiveRequestCountOverflowError",
    "BlockOverflowError",
    "ContextErrorFactory",
    "ContextOverflowError",
    "DynamicInferenceEngine",
    "EngineState",
    "EvictionPolicy",
    "FinishReason",
    "InFlightPolicy",
    "InferenceConfig",
    "LogprobsMode",
    "MaxSequenceLengthOverflowError",
    "RequestOutput",
    "RequestOverflowError",
    "SamplingParams",
    "SuspendedAddPolicy",
    "TensorStateDeallocatedError",
    "TokenOverflowError",
]
