"""Caches a model declares and the engine builds: paged KV and per-request state pools."""
