"""The message schemas of the wire protocol (see `rollout.wire.codec` for framing and rules).

One `msgspec.Struct` per message kind, tagged by `kind` (a `Kind`, `rollout.wire.kinds`); every
message carries the writer's protocol version `v`. Enum fields are the engine's own enums, and a
`Generate`'s sampling is the engine's own `SamplingParams` (its bounds are declared on it).
msgspec checks types and numeric ranges when a frame is decoded; `__post_init__` (run at
construction and at decode) checks the rest, e.g. packed-array lengths, and turns packed fields
into numpy arrays (`rollout.wire.packing`). A `ValueError` there names the field. Requests have
kinds below 64, replies 64 and up.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Optional, Union

import msgspec
import numpy as np
from msgspec import Meta

from inference.bounded import NonNegInt
from inference.config import PauseMode, SuspendPolicy, UpdatePolicy
from inference.core.states import EngineState, MemoryTag
from inference.request import FinishReason
from inference.sampling.params import (
    MAX_LOGPROBS,
    MAX_LORA_NAME_LENGTH,
    MAX_SAMPLES,
    SamplingParams,
)
from rollout.wire.kinds import (
    MAX_ABORT_TARGETS,
    MAX_KV_EVENTS,
    MAX_LEASE_SECONDS,
    MAX_REQUEST_ID_LENGTH,
    PROTOCOL_VERSION,
    ErrorCode,
    Kind,
)
from rollout.wire.kv_events import KvEventBatch
from rollout.wire.packing import as_float32, as_int32, check_non_negative, check_same_length
from weight_sync.sources import DEFAULT_GROUP, AdapterSource, GroupName, WeightSource
from weight_sync.transports.distributed import CollectiveBackend

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_LENGTH)]
Hint = Annotated[str, Meta(max_length=MAX_REQUEST_ID_LENGTH)]
TokenLogprobs = Annotated[dict[NonNegInt, float], Meta(max_length=MAX_LOGPROBS + 1)]
Seconds = Annotated[float, Meta(ge=0)]
StatValue = Union[int, float, str]


def _field_eq(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and np.array_equal(a, b, equal_nan=np.issubdtype(a.dtype, np.floating))
    return a == b


class _Message(msgspec.Struct, tag_field="kind", forbid_unknown_fields=True, kw_only=True, eq=False):
    """Base of every message: the `kind` tag (class keyword `tag`) and the writer's version `v`."""

    v: int = PROTOCOL_VERSION

    # NOTE: msgspec's own __eq__ would ask numpy arrays for a single truth value; compare
    # packed arrays element-wise (dtype included) instead.
    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_field_eq(getattr(self, f), getattr(other, f)) for f in self.__struct_fields__)

    # NOTE: msgspec.Struct's own `!=` does not invert the `__eq__` above: define it too
    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]


class _Request(_Message):
    """A request. Each kind declares here, once, what the fronts and a router need to know of it
    (class attributes, not fields: nothing of them travels)."""

    request_id: RequestId

    broadcast: ClassVar[bool] = False  # a router sends it to every replica (else it answers it itself)
    stateful: ClassVar[bool] = False  # changes a replica's state: a router's fleet follows it, and a
    #                                   replica that fails it while others took it leaves the fleet
    all_or_refused: ClassVar[bool] = False  # a router answers it only if every replica took it
    collective: ClassVar[bool] = False  # the trainer's weight group takes it at once (forming or leaving it,
    #                                     weights moved over it): a router sends it to replicas that lag too
    counted_as: ClassVar[Optional[str]] = None  # the counter a server or router adds to when one succeeds
    commits_version: ClassVar[bool] = False  # its replies carry the policy version it committed: a router
    #                                          takes the fleet's from them, counts it in flight until all
    #                                          answered, and a lagging replica that took it is in step again

    @property
    def ranked(self) -> bool:
        """Whether each replica of a broadcast gets its own copy (`for_replica`), replicas in name order."""
        return False

    def for_replica(self, index: int) -> _Request:
        """What the `index`-th replica of a broadcast gets (in name order where `ranked`): this request."""
        return self


# ---- requests --------------------------------------------------------------------------------


LoraName = Annotated[str, Meta(min_length=1, max_length=MAX_LORA_NAME_LENGTH)]


class Generate(_Request, tag=Kind.GENERATE.value):
    """Sample `sampling.n` completions of one prompt; `session_id` / `group_id` are routing hints, and
    `session_id` is the engine's `SamplingParams.session_id` too (a salted session's turns).
    `client`: whom a forwarder (a router) sends it for; a server admits its connections in turns
    and, within one connection, the clients it names (so a router's clients take turns too)."""

    prompt_token_ids: np.ndarray  # packed int32, at least one token, ids >= 0
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream_tokens: bool = False
    session_id: Optional[Hint] = None
    group_id: Optional[Hint] = None
    client: Optional[Hint] = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = as_int32("prompt_token_ids", self.prompt_token_ids)
        if self.prompt_token_ids.size == 0:
            raise ValueError("prompt_token_ids must not be empty")
        check_non_negative("prompt_token_ids", self.prompt_token_ids)


class Abort(_Request, tag=Kind.ABORT.value):
    """Finish the `targets` (Generate request ids) now with reason `abort`, partial tokens sent."""

    targets: Annotated[list[RequestId], Meta(min_length=1, max_length=MAX_ABORT_TARGETS)]


class Pause(_Request, tag=Kind.PAUSE.value):
    broadcast: ClassVar[bool] = True
    stateful: ClassVar[bool] = True
    counted_as: ClassVar[Optional[str]] = "pauses"

    mode: PauseMode


class Continue(_Request, tag=Kind.CONTINUE.value):
    """Undo `Pause`."""

    broadcast: ClassVar[bool] = True
    stateful: ClassVar[bool] = True


class Suspend(_Request, tag=Kind.SUSPEND.value):
    """Free the KV / state buffers (and the weights if `offload_weights`) for a colocated trainer;
    `tags`: the parts to free instead (each part once, `inference.core.states.MemoryTag`);
    `discard_weights`: drop the weights rather than keep a host copy (vLLM's sleep level 2);
    `policy` None: the engine's configured one (`InferenceConfig.suspend_policy`)."""

    broadcast: ClassVar[bool] = True
    stateful: ClassVar[bool] = True
    counted_as: ClassVar[Optional[str]] = "suspends"

    policy: Optional[SuspendPolicy] = None
    offload_weights: bool = False
    tags: Optional[Annotated[list[MemoryTag], Meta(min_length=1, max_length=2)]] = None
    discard_weights: bool = False


class Resume(_Request, tag=Kind.RESUME.value):
    """Undo `Suspend` (`tags`: only those parts; a part awake already is left as it is)."""

    broadcast: ClassVar[bool] = True
    stateful: ClassVar[bool] = True
    counted_as: ClassVar[Optional[str]] = "resumes"

    tags: Optional[Annotated[list[MemoryTag], Meta(min_length=1, max_length=2)]] = None


class UpdateWeights(_Request, tag=Kind.UPDATE_WEIGHTS.value):
    """Load new weights from `source` (`weight_sync.sources`) and commit them atomically under the
    version it says (its manifest's; None: current + 1); `policy` says what happens to requests in
    flight (None: the engine's configured default). A distributed source with `finish` False leaves
    the update open for the next call (the reply's version is still the old one)."""

    broadcast: ClassVar[bool] = True
    stateful: ClassVar[bool] = True
    counted_as: ClassVar[Optional[str]] = "weight_updates"
    commits_version: ClassVar[bool] = True

    source: WeightSource
    policy: Optional[UpdatePolicy] = None

    @property
    def collective(self) -> bool:  # type: ignore[override]
        """Weights moved in memory over the group (a broadcast, a shared-memory segment, a delta with
        its full manifest). A directory is not (each replica reads it, again if it must), nor a
        version alone (it moves no weights: it would mislabel a lagging replica's old ones)."""
        return self.source.collective


# ---- weight sync: the weight-update group (SGLang's calls; sources above) ---------------------


class InitWeightsUpdateGroup(_Request, tag=Kind.INIT_WEIGHTS_UPDATE_GROUP.value):
    """Join the trainer's weight-update group (SGLang's field names): the trainer is rank 0 at
    `master_address:master_port`; this replica is rank `rank_offset`, or (None) the next free
    one, so one message broadcast to every replica works. `backend` None: gloo on CPU, nccl on
    GPU. Every collective of the group times out after `timeout_s` (None: the server's)."""

    broadcast: ClassVar[bool] = True
    collective: ClassVar[bool] = True

    master_address: Annotated[str, Meta(min_length=1, max_length=255)]
    master_port: Annotated[int, Meta(ge=1, le=65535)]
    world_size: Annotated[int, Meta(ge=2, le=65536)]
    rank_offset: Optional[Annotated[int, Meta(ge=1)]] = None
    group_name: GroupName = DEFAULT_GROUP
    backend: Optional[CollectiveBackend] = None
    timeout_s: Optional[Annotated[float, Meta(gt=0, le=MAX_LEASE_SECONDS)]] = None

    @property
    def ranked(self) -> bool:  # type: ignore[override]
        return self.rank_offset is not None

    def for_replica(self, index: int) -> InitWeightsUpdateGroup:
        """The fleet stands for one engine of as many workers as replicas, as vLLM's and SGLang's
        `rank_offset` means: worker `index` (replicas in name order) is rank `rank_offset + index`."""
        return self if self.rank_offset is None else msgspec.structs.replace(self, rank_offset=self.rank_offset + index)


class DestroyWeightsUpdateGroup(_Request, tag=Kind.DESTROY_WEIGHTS_UPDATE_GROUP.value):
    broadcast: ClassVar[bool] = True
    collective: ClassVar[bool] = True

    group_name: GroupName = DEFAULT_GROUP


class GetWeightVersion(_Request, tag=Kind.GET_WEIGHT_VERSION.value):
    """The policy version (`Result.policy_version`; SGLang spells it as a string)."""

    broadcast: ClassVar[bool] = True


class IsSleeping(_Request, tag=Kind.IS_SLEEPING.value):
    """Whether the engine is suspended (`Result.sleeping`; through a router: every replica is)."""

    broadcast: ClassVar[bool] = True


class LoadLora(_Request, tag=Kind.LOAD_LORA.value):
    """Load the PEFT adapter in the directory `lora_path` (as the server reads it) as `lora_name`;
    a name loaded already gets its next version (`Result.loras`: the adapter as loaded)."""

    broadcast: ClassVar[bool] = True

    lora_name: LoraName
    lora_path: Annotated[str, Meta(min_length=1, max_length=4096)]


class UnloadLora(_Request, tag=Kind.UNLOAD_LORA.value):
    broadcast: ClassVar[bool] = True

    lora_name: LoraName


class SyncLora(_Request, tag=Kind.SYNC_LORA.value):
    """A trainer's adapter-only sync (`weight_sync.lora_sync`): adapter `source.name`'s tensors over
    a weight-update group or in shared memory, committed whole as its next version
    (`Result.loras`: the adapter as committed; `Result.stats["bytes_received"]`: this update's)."""

    broadcast: ClassVar[bool] = True
    collective: ClassVar[bool] = True
    all_or_refused: ClassVar[bool] = True

    source: AdapterSource


class ListLoras(_Request, tag=Kind.LIST_LORAS.value):
    """The loaded adapters (`Result.loras`)."""

    broadcast: ClassVar[bool] = True


class LoraInfo(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A loaded adapter: its name, current version, rank and the path it was read from."""

    name: LoraName
    version: NonNegInt
    rank: Annotated[int, Meta(ge=1)]
    path: Optional[str] = None


class ResetPrefixCache(_Request, tag=Kind.RESET_PREFIX_CACHE.value):
    broadcast: ClassVar[bool] = True
    stateful: ClassVar[bool] = True

    pass


class Stats(_Request, tag=Kind.STATS.value):
    broadcast: ClassVar[bool] = True

    pass


class Health(_Request, tag=Kind.HEALTH.value):
    pass


class Heartbeat(_Request, tag=Kind.HEARTBEAT.value):
    """Renews the sender's lease for `lease_s` seconds (None: the server's default)."""

    lease_s: Optional[Annotated[float, Meta(gt=0, le=MAX_LEASE_SECONDS)]] = None


class KvEvents(_Request, tag=Kind.KV_EVENTS.value):
    """The replica's prefix-cache events numbered `since` and later (at most `max_events`), for a
    router's prefix-aware placement. Answered without the engine, from the server's event log."""

    since: NonNegInt = 0
    max_events: Annotated[int, Meta(ge=1, le=MAX_KV_EVENTS)] = 4096


# ---- replies ---------------------------------------------------------------------------------


class RoutedExperts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An MoE sample's routing (`return_routed_experts`): the experts chosen at each position fed
    to the model (prompt + generated but the last), per MoE layer, `k` each: `experts` is the
    packed int32 array of `[positions, layers, k]` in row-major order."""

    layers: Annotated[int, Meta(ge=1)]
    k: Annotated[int, Meta(ge=1)]
    experts: np.ndarray

    def __post_init__(self) -> None:
        self.experts = as_int32("routed_experts", self.experts)
        check_non_negative("routed_experts", self.experts)
        if self.experts.size % (self.layers * self.k):
            raise ValueError(f"RoutedExperts: {self.experts.size} entries are not whole positions of "
                             f"{self.layers} layers x {self.k}")

    @property
    def array(self) -> np.ndarray:
        return self.experts.reshape(-1, self.layers, self.k)


class SampleOutput(_Message, tag=Kind.SAMPLE_OUTPUT.value):
    """One finished sample of a Generate (`sample_index` of its `n`).

    `token_ids`, `logprobs` (float32) and `versions` (the policy version that sampled each
    token) are packed arrays, one entry per generated token. `top_logprobs` is None or one dict
    {token id: log-prob} per generated token; `prompt_logprobs` None or one entry per prompt
    token (the first None: nothing predicts it). `ttft` / `latency` are seconds since arrival.
    """

    request_id: RequestId
    sample_index: NonNegInt
    n: Annotated[int, Meta(ge=1, le=MAX_SAMPLES)]
    prompt_len: Annotated[int, Meta(ge=1)]
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    top_logprobs: Optional[list[TokenLogprobs]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    # each prompt token's vocabulary rank (vLLM's; the first None), beside `prompt_logprobs`
    prompt_logprob_ranks: Optional[list[Optional[Annotated[int, Meta(ge=1)]]]] = None
    ttft: Optional[Seconds] = None
    latency: Optional[Seconds] = None
    num_preemptions: NonNegInt = 0
    routed_experts: Optional[RoutedExperts] = None
    cached_tokens: NonNegInt = 0  # prompt tokens the prefix cache served (SGLang's `cached_tokens`)
    # the LoRA adapter version that sampled every token (PIN: one per request; None: the base model)
    lora_version: Optional[NonNegInt] = None

    def __post_init__(self) -> None:
        if self.sample_index >= self.n:
            raise ValueError(f"sample_index {self.sample_index} must be < n ({self.n})")
        _unpack_tokens(self, "SampleOutput")
        self.finish_reason = FinishReason(self.finish_reason)
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.token_ids):
            raise ValueError(f"SampleOutput: top_logprobs ({len(self.top_logprobs)}) must have one entry "
                             f"per token ({len(self.token_ids)})")
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) != self.prompt_len:
            raise ValueError(f"SampleOutput: prompt_logprobs ({len(self.prompt_logprobs)}) must have one "
                             f"entry per prompt token ({self.prompt_len})")
        if self.prompt_logprob_ranks is not None and len(self.prompt_logprob_ranks) != self.prompt_len:
            raise ValueError(f"SampleOutput: prompt_logprob_ranks ({len(self.prompt_logprob_ranks)}) must have "
                             f"one entry per prompt token ({self.prompt_len})")
        fed = self.prompt_len + max(len(self.token_ids) - 1, 0)
        if self.routed_experts is not None and len(self.routed_experts.array) != fed:
            raise ValueError(f"SampleOutput: routed_experts ({len(self.routed_experts.array)} positions) must have "
                             f"one entry per position fed to the model ({fed})")


class TokenDelta(_Message, tag=Kind.TOKEN_DELTA.value):
    """Tokens a streaming sample generated since its last delta; `start` indexes the first one."""

    request_id: RequestId
    sample_index: NonNegInt
    start: NonNegInt
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray

    def __post_init__(self) -> None:
        _unpack_tokens(self, "TokenDelta")


def _unpack_tokens(msg: Union[SampleOutput, TokenDelta], what: str) -> None:
    msg.token_ids = as_int32("token_ids", msg.token_ids)
    msg.logprobs = as_float32("logprobs", msg.logprobs)
    msg.versions = as_int32("versions", msg.versions)
    check_non_negative("token_ids", msg.token_ids)
    check_non_negative("versions", msg.versions)
    check_same_length(what, token_ids=msg.token_ids, logprobs=msg.logprobs, versions=msg.versions)


class HealthInfo(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`serving_error`: why the engine refuses generations though its loop is alive (its weights
    were discarded by a deep sleep and await an update, an in-place update is loading), or None."""

    healthy: bool
    seconds_since_loop_tick: Seconds
    state: EngineState
    policy_version: NonNegInt
    serving_error: Optional[Annotated[str, Meta(max_length=1024)]] = None


class Result(_Message, tag=Kind.RESULT.value):
    """Success of a control request (`request_kind`), with what that kind returns."""

    request_id: RequestId
    request_kind: Kind
    policy_version: Optional[NonNegInt] = None
    stats: Optional[dict[str, StatValue]] = None
    health: Optional[HealthInfo] = None
    kv_events: Optional[KvEventBatch] = None
    sleeping: Optional[bool] = None
    loras: Optional[list[LoraInfo]] = None


class ErrorReply(_Message, tag=Kind.ERROR.value):
    """A refused frame or request; `context_error` is `ContextErrorFactory.serialize`'s dict."""

    code: ErrorCode
    message: str
    request_id: Optional[Hint] = None
    context_error: Optional[dict[str, Union[str, int, bool, None]]] = None


RequestMessage = Union[Generate, Abort, Pause, Continue, Suspend, Resume, UpdateWeights, ResetPrefixCache,
                       Stats, Health, Heartbeat, KvEvents, InitWeightsUpdateGroup, DestroyWeightsUpdateGroup,
                       GetWeightVersion, IsSleeping, LoadLora, UnloadLora, ListLoras, SyncLora]
ReplyMessage = Union[SampleOutput, TokenDelta, Result, ErrorReply]
Message = Union[RequestMessage, ReplyMessage]

REQUEST_TYPES: tuple[type, ...] = RequestMessage.__args__
REPLY_TYPES: tuple[type, ...] = ReplyMessage.__args__


def kind_of(message_type: type) -> Kind:
    """The `Kind` a message class is tagged with."""
    return Kind(message_type.__struct_config__.tag)


# the kinds a router sends to every replica (each declares it: `_Request.broadcast`)
BROADCAST_KINDS = frozenset(kind_of(t) for t in REQUEST_TYPES if t.broadcast)
