"""The engine's weights: the policy version, the trainer binding, staged updates, layout adapters."""
