"""The clients of a rollout service: sync and asyncio, their streams, the connection, the SGLang-named weight calls."""
