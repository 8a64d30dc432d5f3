"""Sampling: per-request parameters, the vectorised sampler, truncation and its native fast path."""
