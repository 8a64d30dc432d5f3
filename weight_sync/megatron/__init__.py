"""megatron-core on both ends: its parameter names and layouts, the model adapter, TP gather."""
