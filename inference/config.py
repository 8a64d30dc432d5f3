"""Engine configuration: one validated dataclass, checked once at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from inference.kv_cache.policy import EvictionPolicy, PrefixCachePolicy

__all__ = ["EvictionPolicy", "InferenceConfig", "PauseMode", "PrefixCachePolicy", "StalePolicy", "SuspendPolicy",
           "SuspendedAddPolicy", "UpdatePolicy"]


class SuspendPolicy(str, enum.Enum):
    """What `suspend()` does with requests in flight (they hold KV blocks the trainer wants).

    ABORT: they finish with reason `abort`, partial tokens returned.
    RECOMPUTE: released and queued again; prompt + tokens so far are prefilled again on resume.
    OFFLOAD: their KV blocks are copied to host memory and come back on resume.
    """

    ABORT = "abort"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


class UpdatePolicy(str, enum.Enum):
    """What a weight update does with requests in flight.

    ABORT: they finish with reason `abort`. RECOMPUTE: their KV (computed by the old weights) is
    dropped and recomputed by the new ones. KEEP: they go on with their old KV; the tokens they
    sample from now on carry the new version.
    """

    ABORT = "abort"
    RECOMPUTE = "recompute"
    KEEP = "keep"


class StalePolicy(str, enum.Enum):
    """What is done with a sample (or session) started more than `max_staleness` versions ago.

    RECOMPUTE: it starts again from its prompt under the current version (its tokens so far are
    dropped, never trained on). ABORT: it finishes now with reason `stale` and the tokens it has.
    """

    RECOMPUTE = "recompute"
    ABORT = "abort"


class PauseMode(str, enum.Enum):
    """What `pause()` does with requests in flight; new requests queue until `continue_()`.

    ABORT: finish them now with their partial tokens. WAIT: admit nothing new and let the
    admitted ones run to completion (`pause` returns once they have). KEEP: freeze them with
    their KV. RETRACT: release their KV and queue them to be recomputed on continue.
    """

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"
    RETRACT = "retract"


class SuspendedAddPolicy(str, enum.Enum):
    """`add_request` while suspended: RAISE a transient TensorStateDeallocatedError, or QUEUE it."""

    RAISE = "raise"
    QUEUE = "queue"


DEFAULT_MAX_SAMPLES_PER_REQUEST = 32_768

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class SpeculativeConfig:
    """Draft-free speculative decoding for the tail of a batch (see `inference/speculation/`).

    A decode-only step of at most `max_rows` requests proposes up to `num_tokens` tokens per
    request from n-gram matches (`min_match`..`max_match` tokens of the request's own suffix) in
    its own tokens, its group's siblings and the last `history_samples` finished samples of each of
    `history_prompts` prompts, each proposal with its estimated chance of being kept (the share of
    matches that continued with it; proposals below `min_acceptance` are not made). The step
    verifies the proposals that maximise tokens per second under the cost of a step by its token
    count, at most `max_step_tokens` tokens (rows included): `cost_model="measured"` times the
    engine's own decode steps, `"flat"` takes every step up to `max_step_tokens` as costing the
    same (where a forward has room to spare; the choice then does not depend on timing).
    Lossless: a proposed token is kept only where it equals the token the target samples there
    with the randomness of that position.
    """

    num_tokens: int = 8
    max_rows: int = 16
    max_step_tokens: int = 48
    min_acceptance: float = 0.05
    min_match: int = 2
    max_match: int = 8
    history_samples: int = 16
    history_prompts: int = 1024
    cost_model: str = "measured"

    def __post_init__(self) -> None:
        for name in ("num_tokens", "max_rows", "max_step_tokens", "min_match", "max_match", "history_prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SpeculativeConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.history_samples, int) or self.history_samples < 0:
            raise ValueError(f"SpeculativeConfig.history_samples must be an int >= 0, got {self.history_samples!r}")
        if not 0.0 < self.min_acceptance < 1.0:
            raise ValueError(f"SpeculativeConfig.min_acceptance must be in (0, 1), got {self.min_acceptance!r}")
        if self.cost_model not in ("measured", "flat"):
            raise ValueError(f"SpeculativeConfig.cost_model must be 'measured' or 'flat', got {self.cost_model!r}")
        if self.max_match < self.min_match:
            raise ValueError(f"SpeculativeConfig.max_match ({self.max_match}) must be >= min_match ({self.min_match})")


@dataclass(slots=True)
class InferenceConfig:
    """How big the engine is and how it schedules.

    Give the KV pool's size either as `num_blocks` or as `kv_memory_bytes` (converted once the
    model's layer shapes are known); with neither, 256 MiB. `max_batch_tokens` bounds the tokens of
    one step (decode tokens plus prefill chunks; not to be confused with `SamplingParams.max_tokens`,
    the tokens of one request); `chunked_prefill_size` bounds one request's prefill chunk.
    `paused_block_budget` bounds the blocks held by paused requests (None: a quarter of the pool);
    past it the most recently paused are evicted and later recomputed. `suspend_policy` and
    `update_policy` are the defaults for requests in flight at a suspend / a weight update.

    Admission bounds (samples are prompts x n): one call may ask for at most
    `max_samples_per_request` (more is refused as invalid), and a call is refused as overloaded
    (`OverloadedError`, retry later) while it would take the samples not yet in a slot, all clients
    together, past `max_waiting_samples`. The defaults take one 32,768-sample GRPO batch (e.g. 128
    prompts x n=256) with as much again queued beside it by others (about 1 KB of host memory per
    waiting sample); size the queue bound to the wait a caller tolerates: it drains at the engine's
    rate of samples per second.
    """

    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_memory_bytes: Optional[int] = None
    max_requests: int = 256
    max_batch_tokens: int = 2048
    max_sequence_length: int = 4096
    chunked_prefill_size: int = 512
    enable_prefix_caching: bool = True
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    paused_block_budget: Optional[int] = None
    # "auto": the checkpoint's dtype (its config's `dtype` / `torch_dtype`, a module's parameters'),
    # as vLLM's `--dtype auto`; resolved by `DynamicInferenceEngine.from_pretrained`
    dtype: torch.dtype | str = "auto"
    device: torch.device | str = "cpu"
    suspend_policy: SuspendPolicy = SuspendPolicy.RECOMPUTE
    update_policy: UpdatePolicy = UpdatePolicy.RECOMPUTE
    suspended_add_policy: SuspendedAddPolicy = SuspendedAddPolicy.RAISE
    record_kv_events: bool = False
    # fault in every page of the KV pool when it is allocated (at start and on each resume), as vLLM
    # allocates its cache: no first-touch faults inside the first rollouts, the pool's time to clear
    # paid up front (~0.1 s a GiB; up to 2.3 s on a VM whose host backs fresh memory lazily); off, the
    # pages are touched as requests first use them (a colocated trainer gets back what was never used)
    prefault_kv: bool = False
    # RESET: each weight update makes the prefix cache unmatchable; SALTED: requests, groups and
    # sessions keep matching the blocks of the version they started with (see PrefixCachePolicy)
    prefix_cache_policy: PrefixCachePolicy = PrefixCachePolicy.RESET
    # samples and sessions started more than this many versions ago are handled per stale_policy
    # at each update, before anything is prefilled again (None: no bound); a salted version's
    # blocks are freed once it is this far behind
    max_staleness: Optional[int] = None
    stale_policy: StalePolicy = StalePolicy.RECOMPUTE
    max_sessions: int = 65_536  # sessions whose start version the engine remembers (LRU)
    # Mamba prefix caching (models with per-request state): state snapshots at KV block boundaries,
    # in a pool of their own, sized in slots or in bytes; None for both: one slot per request slot
    # (max_requests). 0 turns prefix caching off for such models (a KV hit would skip their state).
    state_snapshot_slots: Optional[int] = None
    state_snapshot_bytes: Optional[int] = None
    # pad each step's tokens to the smallest of these sizes (CUDA graphs replay a few shapes);
    # None: no padding (the CPU default: padding only costs compute there)
    batch_buckets: Optional[tuple[int, ...]] = None
    # decode-only steps pad their requests (one token each) to these instead (None: batch_buckets)
    decode_buckets: Optional[tuple[int, ...]] = None
    # capture the model once per bucket and replay it (CUDA only; needs buckets); suspend frees the
    # graphs and their memory pool, resume captures them again
    cuda_graphs: bool = False
    max_samples_per_request: Optional[int] = None  # None: 32,768, or max_waiting_samples if that is less
    max_waiting_samples: int = 65_536
    # structured outputs compile grammars against this tokenizer (a tokenizer.json or its
    # directory); None: the model's directory when built from one (`from_pretrained`), else none
    # (such an engine refuses structured outputs)
    tokenizer: Optional[str] = None
    # draft-free speculative decoding of small decode-only steps (None: off; see SpeculativeConfig)
    speculative: Optional[SpeculativeConfig] = None
    # LoRA: adapter names loaded at once (0: no adapters), and the largest rank one may have
    max_loras: int = 4
    max_lora_rank: int = 64
    # versions of one adapter resident at once beyond its current one (the in-flight requests of a
    # replaced version finish on it, PIN); a reload past that is refused until they finished
    lora_max_staleness: int = 1
    # batch invariance: a request's tokens and log-probs are the same bits whatever else shares its
    # steps (alone or among hundreds, its prompt chunked anywhere, its prefix cached or not, preempted
    # and recomputed): every product in the native kernels' fixed order at any row count (fp32 past
    # 128 rows too, where MKL's blocking would follow the row count). CPU, fp32 or bf16, the dense
    # decoder with the native kernels; LoRA adapters, hybrid and MoE models are refused in it.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "max_requests", "max_batch_tokens", "max_sequence_length", "chunked_prefill_size",
                     "max_waiting_samples", "max_samples_per_request", "max_sessions"):
            value = getattr(self, name)
            if name == "max_samples_per_request" and value is None:
                value = self.max_samples_per_request = min(DEFAULT_MAX_SAMPLES_PER_REQUEST, self.max_waiting_samples)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"InferenceConfig.{name} must be a positive int, got {value!r}")
        for name, low in (("max_loras", 0), ("max_lora_rank", 1), ("lora_max_staleness", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"InferenceConfig.{name} must be an int >= {low}, got {value!r}")
        if self.num_blocks is not None and self.kv_memory_bytes is not None:
            raise ValueError("InferenceConfig: give num_blocks or kv_memory_bytes, not both")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"InferenceConfig.num_blocks must be a positive int, got {self.num_blocks!r}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ValueError(f"InferenceConfig.kv_memory_bytes must be positive, got {self.kv_memory_bytes!r}")
        if self.state_snapshot_slots is not None and self.state_snapshot_bytes is not None:
            raise ValueError("InferenceConfig: give state_snapshot_slots or state_snapshot_bytes, not both")
        for name in ("state_snapshot_slots", "state_snapshot_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"InferenceConfig.{name} must be None or an int >= 0, got {value!r}")
        if self.paused_block_budget is not None and self.paused_block_budget < 0:
            raise ValueError(f"InferenceConfig.paused_block_budget must be >= 0, got {self.paused_block_budget}")
        if self.max_samples_per_request > self.max_waiting_samples:
            raise ValueError(
                f"InferenceConfig.max_samples_per_request ({self.max_samples_per_request}) must be <= "
                f"max_waiting_samples ({self.max_waiting_samples}): a request that large could never be queued"
            )
        if self.max_batch_tokens < self.max_requests:
            raise ValueError(
                f"InferenceConfig.max_batch_tokens ({self.max_batch_tokens}) must be >= max_requests "
                f"({self.max_requests}): every running request decodes one token per step"
            )
        if isinstance(self.dtype, str) and self.dtype != "auto":
            if self.dtype not in _DTYPES:
                raise ValueError(f"InferenceConfig.dtype must be auto or one of {sorted(_DTYPES)}, "
                                 f"got {self.dtype!r}")
            self.dtype = _DTYPES[self.dtype]
        if self.dtype != "auto" and self.dtype not in _DTYPES.values():
            raise ValueError(f"InferenceConfig.dtype must be float32, bfloat16 or float16, got {self.dtype}")
        self.device = torch.device(self.device)
        self.eviction_policy = EvictionPolicy(self.eviction_policy)
        for name in ("batch_buckets", "decode_buckets"):
            value = getattr(self, name)
            if value is not None:
                buckets = tuple(value)
                if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets) \
                        or list(buckets) != sorted(set(buckets)):
                    raise ValueError(f"InferenceConfig.{name} must be increasing positive ints, got {buckets!r}")
                setattr(self, name, buckets)
        if self.decode_buckets is not None and self.batch_buckets is None:
            raise ValueError("InferenceConfig.decode_buckets needs batch_buckets (the buckets of steps that prefill)")
        if self.cuda_graphs and (self.batch_buckets is None or self.device.type != "cuda"):
            raise ValueError("InferenceConfig.cuda_graphs needs batch_buckets and a CUDA device, got "
                             f"batch_buckets={self.batch_buckets}, device={self.device}")
        self.suspend_policy = SuspendPolicy(self.suspend_policy)
        self.update_policy = UpdatePolicy(self.update_policy)
        self.suspended_add_policy = SuspendedAddPolicy(self.suspended_add_policy)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"InferenceConfig.speculative must be a SpeculativeConfig or None, "
                             f"got {self.speculative!r}")
        self.prefix_cache_policy = PrefixCachePolicy(self.prefix_cache_policy)
        self.stale_policy = StalePolicy(self.stale_policy)
        if self.batch_invariant and self.device.type != "cpu":
            raise ValueError(f"InferenceConfig.batch_invariant runs on the CPU's native kernels only, got device "
                             f"{self.device} (its GPU kernels do not fix their order yet)")
        if self.batch_invariant and self.dtype == torch.float16:
            raise ValueError("InferenceConfig.batch_invariant takes float32 or bfloat16 (float16's products are "
                             "oneDNN's, whose order follows the row count)")
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int)
                                               or isinstance(self.max_staleness, bool) or self.max_staleness < 0):
            raise ValueError(f"InferenceConfig.max_staleness must be None or an int >= 0, got {self.max_staleness!r}")

    @property
    def largest_bucket(self) -> int:
        """The most tokens a padded step can have (0 without buckets)."""
        return max((*(self.batch_buckets or ()), *(self.decode_buckets or ()), 0))

    @property
    def max_blocks_per_request(self) -> int:
        return -(-self.max_sequence_length // self.block_size)

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """The pool's block count, given the KV bytes one block takes across all layers."""
        if self.num_blocks is not None:
            return self.num_blocks
        budget = self.kv_memory_bytes if self.kv_memory_bytes is not None else 256 * 2**20
        blocks = budget // bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"InferenceConfig.kv_memory_bytes={budget} holds no block of {bytes_per_block} bytes"
            )
        return int(blocks)

    def resolve_state_snapshot_slots(self, bytes_per_slot: int) -> int:
        """Slots of the state-snapshot pool, given the bytes of one request's state."""
        if self.state_snapshot_slots is not None:
            return self.state_snapshot_slots
        if self.state_snapshot_bytes is not None:
            return self.state_snapshot_bytes // max(1, bytes_per_slot)
        return self.max_requests

    def resolve_paused_block_budget(self, num_blocks: int) -> int:
        return self.paused_block_budget if self.paused_block_budget is not None else max(1, num_blocks // 4)
