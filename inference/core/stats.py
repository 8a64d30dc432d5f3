"""`EngineCore.stats()`: the counters and settings of one engine's parts, by name (what the engine's
`stats()`, the server's Stats reply and the HTTP metrics read)."""

from __future__ import annotations

from typing import Any


def core_stats(core: Any) -> dict:  # NOTE: an EngineCore (typed loosely: it imports this module)
    """The core's counters and settings by name, as `DynamicInferenceEngine.stats()` reports them."""
    pool = core.allocator.stats()
    by_client = core.scheduler.waiting_samples()
    return {
        "state": core.state.value,
        "asleep": ",".join(sorted(tag.value for tag in core.sleep.asleep)),
        "pause_mode": None if core.pause_mode is None else core.pause_mode.value,
        "dtype": str(core.model.spec.dtype).removeprefix("torch."),
        "block_size": core.config.block_size,
        "max_requests": core.config.max_requests,
        "max_sequence_length": core.config.max_sequence_length,
        "max_loras": core.config.max_loras,
        "max_lora_rank": core.config.max_lora_rank,
        "lora_resident_versions": core.loras.resident_versions,  # every version of every adapter held
        "lora_adapter_bytes": core.loras.adapter_bytes,
        "steps": core.num_steps,
        "generated_tokens": core.generated_tokens,
        "prefill_tokens": core.context.prefill_tokens,
        "prefix_cached_tokens": core.context.prefix_cached_tokens,
        "prompt_logprobs_cached": core.context.prompt_logprobs_cached,
        "prefix_hit_blocks": pool.hit_blocks,
        "prefix_hit_rate": pool.hit_rate,
        "cross_version_prefix_hits": core.context.cross_version_hits,
        "prefix_cache_policy": core.config.prefix_cache_policy.value,
        "sessions": core.scheduler.salts.session_count(),
        "stale_aborted": core.stale_aborted,
        "stale_restarted": core.stale_restarted,
        **{f"prefix_blocks_version_{v}": n for v, n in sorted(core.allocator.blocks_by_version().items())},
        "policy_version": core.policy_version,
        "weights_serving_error": core.weights.serving_error,
        "weights_spare_bytes": core.weights.spare_bytes(),
        "waiting": len(core.scheduler.waiting),
        "waiting_samples": core.scheduler.num_waiting_samples,
        "waiting_clients": len(by_client),
        "waiting_samples_largest_client": max(by_client.values(), default=0),
        "max_waiting_samples": core.config.max_waiting_samples,
        "max_samples_per_request": core.config.max_samples_per_request,
        "preemptions": core.scheduler.num_preemptions,
        **core.context.get_kvcache_utilization_stats(),
        **core.caches.stats(),
        **core.runner.stats(),
        **(core.ep.stats() if core.ep is not None else {}),
        **(core.speculation.stats() if core.speculation is not None else {}),
        **(core.context.state_prefix.stats() if core.context.state_prefix is not None else {}),
    }
