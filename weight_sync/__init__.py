"""Getting trainer weights into an engine: megatron-core naming and layouts, CPU shims.

Importing this package registers the megatron-core weight adapter with `inference`, so
`engine.bind_trainer_model(gpt_model)` and `engine.update_weights(megatron_named_tensors)` work.
"""

from weight_sync import megatron_model  # noqa: F401  (registers the megatron-core adapter)
from weight_sync.naming import Naming, detect_naming, hf_to_megatron, megatron_to_hf

__all__ = ["Naming", "detect_naming", "hf_to_megatron", "megatron_to_hf"]
