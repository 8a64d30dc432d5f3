"""Getting trainer weights into engines: in process (aliasing, megatron-core layouts) and across
processes (a manifest, buckets with checksums, one commit; over torch.distributed, shared memory
or disk).

A megatron-core trainer passes `MEGATRON_ADAPTER` to the engine where its layout is used:
`engine.bind_trainer_model(gpt_model, adapter=MEGATRON_ADAPTER)`,
`engine.update_weights(megatron_named_tensors, adapter=MEGATRON_ADAPTER)`. Importing this package
registers nothing.

A trainer of a LoRA adapter syncs the adapter alone: `WeightSender.sync_lora(name, peft_model)`
(`weight_sync.lora_sync`: its tensors over gloo / NCCL / shm, the adapter's next version on every replica).
"""

from inference.weights.staging import Staging  # how an update is staged (double / in place): part of the wire sources
from weight_sync.control import WeightControl
from weight_sync.delta_manifest import BaseMismatchError, DeltaError
from weight_sync.lora_sync import AdapterConfig, AdapterOutcome
from weight_sync.manifest import Manifest, ManifestError, parse_weight_version
from weight_sync.megatron.model import MEGATRON_ADAPTER
from weight_sync.megatron.names import Naming, detect_naming, hf_to_megatron, megatron_to_hf
from weight_sync.receiver import UpdateOutcome, WeightReceiver
from weight_sync.sender import SyncError, WeightSender
from weight_sync.sources import (
    DEFAULT_GROUP,
    AdapterSource,
    DeltaSource,
    DiskSource,
    DistributedSource,
    SharedMemorySource,
    VersionSource,
    WeightSource,
    decode_tensor_payload,
    encode_tensor_payload,
    source_version,
    with_version,
)
from weight_sync.transports import Transport
from weight_sync.transports.checkpoint_files import CheckpointError, DiskAccess, DiskAccessError
from weight_sync.transports.distributed import WeightGroup

__all__ = [
    "DEFAULT_GROUP", "MEGATRON_ADAPTER", "AdapterConfig", "AdapterOutcome", "AdapterSource", "BaseMismatchError",
    "CheckpointError", "DeltaError", "DeltaSource",
    "DiskAccess", "DiskAccessError", "DiskSource",
    "DistributedSource", "Manifest", "ManifestError", "Naming",
    "SharedMemorySource", "Staging", "SyncError", "Transport", "UpdateOutcome", "VersionSource", "WeightControl",
    "WeightGroup",
    "WeightReceiver", "WeightSender", "WeightSource", "decode_tensor_payload", "detect_naming", "encode_tensor_payload",
    "hf_to_megatron", "megatron_to_hf", "parse_weight_version", "source_version", "with_version",
]
