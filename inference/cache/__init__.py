"""Device memory from the model's cache specs: the paged KV buffer, per-request state pools, snapshots."""
