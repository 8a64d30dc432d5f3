"""Getting trainer weights into engines: in process (aliasing, megatron-core layouts) and across
processes (a manifest, buckets with checksums, one commit; over torch.distributed, shared memory
or disk).

Importing this package registers the megatron-core weight adapter with `inference`, so
`engine.bind_trainer_model(gpt_model)` and `engine.update_weights(megatron_named_tensors)` work.
"""

from inference.weights.staging import Staging  # how an update is staged (double / in place): part of the wire sources
from weight_sync.control import WeightControl
from weight_sync.manifest import Manifest, ManifestError, parse_weight_version
from weight_sync.megatron import model  # noqa: F401  (registers the megatron-core adapter)
from weight_sync.megatron.names import Naming, detect_naming, hf_to_megatron, megatron_to_hf
from weight_sync.receiver import UpdateOutcome, WeightReceiver
from weight_sync.sender import SyncError, WeightSender
from weight_sync.sources import (
    DEFAULT_GROUP,
    DiskSource,
    DistributedSource,
    SharedMemorySource,
    WeightSource,
    decode_tensor_payload,
    encode_tensor_payload,
    source_version,
    with_version,
)
from weight_sync.transports import Transport
from weight_sync.transports.distributed import WeightGroup

__all__ = [
    "DEFAULT_GROUP", "DiskSource", "DistributedSource", "Manifest", "ManifestError", "Naming", "SharedMemorySource",
    "Staging", "SyncError", "Transport", "UpdateOutcome", "WeightControl", "WeightGroup", "WeightReceiver",
    "WeightSender", "WeightSource", "decode_tensor_payload", "detect_naming", "encode_tensor_payload", "hf_to_megatron",
    "megatron_to_hf", "parse_weight_version", "source_version", "with_version",
]
