"""`/metrics`: the service's figures in Prometheus' text format (`prometheus-client`), vLLM's names
where vLLM has the metric, ours (`rollout:`) for what only this engine reports.

Each scrape asks the front's client for its stats (one engine, or a router's fleet summed over
its replicas) and renders them through a collector of its own, so nothing is kept between scrapes
and two fronts never share a registry. Counters are the engine's running totals since it started;
gauges its present state. Every sample carries vLLM's `model_name` label (the first served name).

vLLM's: `vllm:num_requests_running` / `_waiting`, `vllm:kv_cache_usage_perc` (0-1, as vLLM's),
`vllm:prompt_tokens` (prefilled + served by the prefix cache), `vllm:generation_tokens`,
`vllm:prefix_cache_queries` / `_hits` (prompt tokens looked up / found), `vllm:num_preemptions`.
Ours: the policy version, weight updates committed / aborted, bytes received, the last sync's
seconds, pauses, suspends, the memory parts asleep, tokens per second, uptime.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inference.core.states import MEMORY_TAGS
from rollout.http.core.errors import from_exception

router = APIRouter()

# (name, help, stats key or keys summed): gauges, then counters
GAUGES = (
    ("vllm:num_requests_running", "Requests in a slot (prefilling or decoding).", ("engine/active_request_count",)),
    ("vllm:num_requests_waiting", "Requests waiting for a slot.", ("engine/waiting",)),
    ("vllm:kv_cache_usage_perc", "Share of the KV cache's blocks in use (0-1).", ("kv_utilization",)),
    ("rollout:policy_version", "The version of the weights serving now.", ("policy_version",)),
    ("rollout:weight_sync_last_seconds", "How long the last weight update took.", ("weight_sync/last_update_seconds",)),
    ("rollout:tokens_per_second", "Tokens generated per second, recent.", ("tokens_per_s",)),
    ("rollout:uptime_seconds", "Seconds since the server started.", ("uptime_s",)),
)
COUNTERS = (
    ("vllm:prompt_tokens", "Prompt tokens, prefilled or served by the prefix cache.",
     ("engine/prefill_tokens", "engine/prefix_cached_tokens")),
    ("vllm:generation_tokens", "Tokens generated.", ("engine/generated_tokens",)),
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     ("engine/prefill_tokens", "engine/prefix_cached_tokens")),
    ("vllm:prefix_cache_hits", "Prompt tokens the prefix cache served.", ("engine/prefix_cached_tokens",)),
    ("vllm:num_preemptions", "Requests preempted (their KV freed, recomputed later).", ("engine/preemptions",)),
    ("rollout:prefix_cache_hits_cross_version", "Prefix-cache hits on blocks an older weight version computed.",
     ("engine/cross_version_prefix_hits",)),
    ("rollout:weight_updates", "Weight updates committed.", ("weight_sync/updates_committed",)),
    ("rollout:weight_updates_aborted", "Weight updates aborted (the old weights kept serving).",
     ("weight_sync/updates_aborted",)),
    ("rollout:weight_sync_bytes", "Bytes of weights received.", ("weight_sync/bytes_received",)),
    ("rollout:pauses", "Pauses asked for.", ("pauses",)),
    ("rollout:suspends", "Suspends asked for.", ("suspends",)),
)


class StatsCollector:
    """A prometheus-client collector over one stats snapshot (see module docstring)."""

    def __init__(self, stats: dict[str, Any], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def _value(self, keys: tuple[str, ...]) -> float:
        return float(sum(float(self.stats.get(k, 0) or 0) for k in keys))

    def collect(self) -> Iterator[Metric]:
        for name, text, keys in GAUGES:
            family = GaugeMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self.model_name], self._value(keys))
            yield family
        for name, text, keys in COUNTERS:
            family = CounterMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self.model_name], self._value(keys))
            yield family
        asleep = GaugeMetricFamily("rollout:asleep", "1 for each memory part suspended now.",
                                   labels=["model_name", "part"])
        parts = str(self.stats.get("engine/asleep", "") or "")
        for part in MEMORY_TAGS:
            asleep.add_metric([self.model_name, part], 1.0 if part in parts.split(",") else 0.0)
        yield asleep


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    front = request.app.state.front
    try:
        stats = await front.client.stats()
    except Exception as exc:  # noqa: BLE001 (the engine's refusal, as its HTTP status)
        raise from_exception(exc) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats, front.config.model_name))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
