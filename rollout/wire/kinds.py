"""The wire's fixed numbers: protocol version, message kinds, error codes, size limits.

Kinds and codes are `IntEnum`s with fixed values: never reuse or renumber one (bump
PROTOCOL_VERSION instead). The engine's own enums (`PauseMode`, `SuspendPolicy`, `UpdatePolicy`,
`FinishReason`, `LogprobsMode`, `Staging`) travel as they are, by value: the wire has no twins.
"""

from __future__ import annotations

import enum

PROTOCOL_VERSION = 20  # 2: UpdateWeights.policy; 3: KvEvents, Result.kv_events; weight sync (group kinds,
# distributed / shared-memory sources); 4: an update's version lives in its source alone (UpdateWeights
# has no target_version; the disk source says the version of a plain checkpoint); IsSleeping, Result.sleeping;
# 5: ErrorCode.OVERLOADED, Generate.client (whom a router forwards for: fair admission behind it); Sampling's
# logit processors (repetition / presence / frequency penalties, min_tokens, logit_bias, bad_words_token_ids,
# allowed_token_ids) and cache_salt; 6: Sampling.structured_outputs; 7: Suspend.tags and
# .discard_weights, Resume.tags (suspend by part); 8: DistributedSource.packed_buffer_bytes (vLLM's packed
# broadcast layout); 9: the delta weight source (DeltaSource); 10: the version-only source (VersionSource);
# 11: SampleOutput.cached_tokens; 12: Sampling.speculative (a request's opt-out of speculative decoding);
# 13: Sampling.prefix_cache_policy, Generate.session_id reaches the engine (salted sessions), KvEvent's salt and
# versions, FinishReason.STALE;
# 14: LoRA adapters (Sampling.lora_name; LoadLora, UnloadLora, ListLoras; Result.loras);
# 15: SyncLora (an adapter-only weight sync: weight_sync.AdapterSource over a group or shared memory);
# 16: SampleOutput.lora_version (the adapter version that sampled a LoRA request's every token);
# 17: HealthInfo.serving_error (why the engine cannot generate, e.g. after a deep sleep), ErrorCode.NO_WEIGHTS;
# 18: SampleOutput.prompt_logprob_ranks (each prompt token's vocabulary rank, vLLM's);
# 19: a Generate's sampling is the engine's own SamplingParams (structured outputs: every field written),
# HealthInfo.state an EngineState, Suspend / Resume tags MemoryTags, InitWeightsUpdateGroup.backend a CollectiveBackend;
# 20: Suspend.policy optional (None: the engine's configured suspend policy)
MAX_REQUEST_ID_LENGTH = 256
MAX_ABORT_TARGETS = 65536
MAX_LEASE_SECONDS = 3600.0
MAX_KV_EVENTS = 65536  # per KvEvents reply


class Kind(enum.IntEnum):
    """Message kinds. Fixed numbers: never reuse or renumber one (bump PROTOCOL_VERSION)."""

    GENERATE = 1
    ABORT = 2
    PAUSE = 3
    CONTINUE = 4
    SUSPEND = 5
    RESUME = 6
    UPDATE_WEIGHTS = 7
    RESET_PREFIX_CACHE = 8
    STATS = 9
    HEALTH = 10
    HEARTBEAT = 11
    KV_EVENTS = 12
    SAMPLE_OUTPUT = 64
    TOKEN_DELTA = 65
    RESULT = 66
    ERROR = 67
    # weight sync (requests, kept together; 12 is the router's KV_EVENTS)
    INIT_WEIGHTS_UPDATE_GROUP = 13
    DESTROY_WEIGHTS_UPDATE_GROUP = 14
    GET_WEIGHT_VERSION = 15
    IS_SLEEPING = 16  # vLLM's is_sleeping: suspended (our sleep) or not
    # LoRA adapters (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, SGLang's, /v1/models)
    LOAD_LORA = 17
    UNLOAD_LORA = 18
    LIST_LORAS = 19
    SYNC_LORA = 20  # an adapter's tensors alone, from a trainer (weight_sync.lora_sync)


class ErrorCode(enum.IntEnum):
    """Why a frame or a request was refused. Stable numbers, as `Kind`."""

    MALFORMED = 1  # not msgpack, truncated, not a map, nested too deep
    UNKNOWN_KIND = 2  # `kind` missing, not a Kind, or a reply where a request was expected
    BAD_SCHEMA = 3  # a field missing, unknown, mistyped or out of range
    TOO_LARGE = 4  # the frame exceeds max_frame_bytes
    BAD_VERSION = 5  # `v` missing or not PROTOCOL_VERSION
    INVALID_REQUEST = 6  # well-formed, but the engine's own validation refused it
    CONTEXT_OVERFLOW = 7  # the engine cannot fit it (now or ever); see ErrorReply.context_error
    ENGINE_STATE = 8  # not allowed in the engine's state (e.g. generate while suspended)
    NOT_FOUND = 9  # e.g. aborting an unknown request id
    DUPLICATE = 10  # a request id reused for a different request
    INTERNAL = 11  # a bug on the server
    OVERLOADED = 12  # the engine's waiting queue is full: nothing wrong with the request, retry later
    NO_WEIGHTS = 13  # no weights fit to serve until a complete weight update (a deep sleep): do not retry on a timer


REQUEST_KINDS = frozenset(k for k in Kind if k < 64)
# control requests a router sends to every replica and answers once (`rollout.router.broadcast`)
REPLY_KINDS = frozenset(k for k in Kind if k >= 64)
