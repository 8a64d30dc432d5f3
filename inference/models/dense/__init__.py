"""Dense decoder-only transformers (Llama, Qwen, SmolLM2 families)."""
