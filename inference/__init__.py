"""rollout-engine's inference engine: one model replica serving many requests at once."""

from inference.config import (
    EvictionPolicy,
    InferenceConfig,
    PauseMode,
    SpeculativeConfig,
    SuspendedAddPolicy,
    SuspendPolicy,
    UpdatePolicy,
)
from inference.core import EngineState, SuspendReport
from inference.engine import DynamicInferenceEngine
from inference.errors import (
    ActiveRequestCountOverflowError,
    BlockOverflowError,
    ContextErrorFactory,
    ContextOverflowError,
    EngineStateError,
    MaxSequenceLengthOverflowError,
    OverloadedError,
    RequestOverflowError,
    ResumeMemoryError,
    TensorStateDeallocatedError,
    TokenOverflowError,
    WeightsUnavailableError,
)
from inference.request import FinishReason, RequestOutput, TokenEvent
from inference.sampling.params import LogprobsMode, SamplingParams
from inference.sampling.structured import StructuredOutputs
from inference.streams import EngineStepError, PendingAdmission, RequestStream
from inference.weights.staging import Staging

__all__ = [
    "ActiveRequestCountOverflowError",
    "BlockOverflowError",
    "ContextErrorFactory",
    "ContextOverflowError",
    "DynamicInferenceEngine",
    "EngineState",
    "EvictionPolicy",
    "FinishReason",
    "EngineStateError",
    "WeightsUnavailableError",
    "OverloadedError",
    "EngineStepError",
    "InferenceConfig",
    "SpeculativeConfig",
    "LogprobsMode",
    "StructuredOutputs",
    "MaxSequenceLengthOverflowError",
    "PauseMode",
    "RequestOutput",
    "RequestOverflowError",
    "PendingAdmission",
    "RequestStream",
    "ResumeMemoryError",
    "SamplingParams",
    "Staging",
    "SuspendPolicy",
    "SuspendReport",
    "SuspendedAddPolicy",
    "TensorStateDeallocatedError",
    "TokenEvent",
    "TokenOverflowError",
    "UpdatePolicy",
]
