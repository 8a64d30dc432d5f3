"""Replicas behind the service: health, failover, placement, broadcast, `rollout route`."""
