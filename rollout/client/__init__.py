"""The clients of a rollout service: sync and asyncio, their streams, the connection, the
SGLang-named weight calls."""

from rollout.client.aio import AsyncRolloutClient
from rollout.client.sync import RolloutClient

__all__ = ["AsyncRolloutClient", "RolloutClient"]
