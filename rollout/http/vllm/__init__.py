"""vLLM's native RL routes: control, weight transfer, LoRA adapters, tokenize."""
