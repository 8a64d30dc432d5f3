"""LoRA adapters served beside the base model: loaded from PEFT directories, resident by name and
version (`registry`), applied per request in a mixed batch, one GEMM pair per adapter (`batch`)."""

from inference.lora.adapter import LORA_PROJECTIONS, LoRAAdapter, load_live_peft_adapter, load_peft_adapter
from inference.lora.batch import LoRABatch
from inference.lora.registry import AdapterInfo, AdapterRef, LoRARegistry

__all__ = ["LORA_PROJECTIONS", "AdapterInfo", "AdapterRef", "LoRAAdapter", "LoRABatch", "LoRARegistry",
           "load_live_peft_adapter", "load_peft_adapter"]
