"""One engine behind the service: `rollout serve`, its dispatch into the engine, the KV event log."""
