"""Where an update's bytes come from, as the wire carries it: the payloads of `UpdateWeights`.

Each is a msgspec struct tagged by `type`, in one union (`WeightSource`) that `UpdateWeights`
carries whole. The version an update commits under lives in the source alone (`source_version`):

* `DiskSource`: the `*.safetensors` files of a directory the replica can read; a plain checkpoint
  has no manifest, so it says its version itself (`version`, None: the replica's next).

The others carry the manifest (`weight_sync.manifest`, with the version), checked before a byte moves:

* `DistributedSource`: broadcasts over a weight-update group the replica joined
  (`init_weights_update_group`); `manifest.layout` None is SGLang's tensor-by-tensor form.
  `finish` makes a sequence of calls one staged update: None commits once every tensor of the
  model is loaded, False keeps the update open for the next call, True commits now.
  `packed_buffer_bytes` (layout None) is vLLM's packed layout (`weight_sync.vllm_layout`): the
  tensors concatenated, one broadcast per chunk cut past that many bytes; None with no layout is
  one broadcast per tensor (SGLang's, and vLLM's unpacked one).
* `SharedMemorySource`: buckets in a /dev/shm segment (CPU) or behind CUDA IPC handles (GPU).
  This is what `update_weights_from_tensor` takes, msgpack-encoded (`encode_tensor_payload`) in
  place of SGLang's pickled tensors, which are refused (`decode_tensor_payload`). A segment is
  filled while the replicas copy it: each `piece_bytes` piece is published in the segment's
  header under this update's `token` with its checksum (`weight_sync.transports.shm`), so the
  manifest's bucket checksums are 0 there.
* `DeltaSource`: what changed since the replica's version `delta.base_version`
  (`weight_sync.delta_manifest`), its payload broadcast over a weight-update group or in a
  shared-memory segment, exactly as a full update's buckets travel; committed only if the
  result hashes as the trainer's full weights do. `full`, when the sender knows some replica is
  not on the base, describes the same update with every tensor FULL, later in the same payload:
  such a replica reads that instead; without it, a replica on another base refuses the delta
  before a byte moves (and the sender's next sync is full).

`staging` (None: the replica's default) chooses double or in-place staging for this update.

Each source says how a fleet of replicas takes it (class attributes, read by the router):
`replayable`, a replica may read it again later on its own (a directory: a replica that lagged
catches up by it); `collective`, the bytes move once for every replica of the trainer's group at
the same time, so it goes to each of them, lagging ones too (a broadcast, a shared-memory
segment, a delta). A version alone is neither: it moves no weights.

`AdapterSource` is not an `UpdateWeights` payload but `SyncLora`'s: one LoRA adapter's tensors
alone (the base weights untouched), their bytes in a `DistributedSource` or `SharedMemorySource`
as above, committed as a version of that adapter (`weight_sync.lora_sync`).
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Optional, Union

import msgspec
from msgspec import Meta

from inference.weights.staging import Staging
from weight_sync.delta_manifest import DeltaManifest
from weight_sync.manifest import ALIGN, Manifest, ManifestError

# NOTE: the wire's types and limits live here, not in `weight_sync.transports` (whose transports
# import these sources), so that no import loop closes between this file and that folder
DEFAULT_GROUP = "weight_update_group"
GroupName = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.\-]+$")]
MAX_PAYLOAD_BYTES = 64 * 2**20
SEGMENT_PREFIX = "rollout-wsync-"
SEGMENT_NAME = re.compile(rf"{SEGMENT_PREFIX}(\d+)-[0-9a-f]{{8,32}}")  # the sender's pid, then random hex
DEFAULT_PIECE_BYTES = 8 * 2**20  # small enough that replicas start copying early, large enough to amortise a wait
MIN_PIECE_BYTES = 64 * 2**10


def check_segment_name(name: str) -> str:
    """`name` if it is a segment of ours (a receiver opens nothing else)."""
    if not SEGMENT_NAME.fullmatch(name):
        raise ValueError(f"shared-memory segment {name!r} is not one of ours ({SEGMENT_PREFIX}<pid>-<hex>)")
    return name


class CudaIpcBuffer(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One bucket's device memory: what `torch.UntypedStorage._share_cuda_()` says of its storage
    (`handle` names the allocator's whole block, `storage_offset` is where the storage starts in
    it, in bytes), and `tensor_offset`, where the bucket starts in the storage, in bytes."""

    device: Annotated[int, Meta(ge=0)]
    handle: bytes
    storage_size: Annotated[int, Meta(ge=0)]
    storage_offset: Annotated[int, Meta(ge=0)]
    tensor_offset: Annotated[int, Meta(ge=0)]
    ref_counter_handle: bytes
    ref_counter_offset: Annotated[int, Meta(ge=0)]
    event_handle: bytes
    event_sync_required: bool


class DiskSource(msgspec.Struct, tag_field="type", tag="safetensors_dir", forbid_unknown_fields=True, kw_only=True):
    """Weights from the `*.safetensors` files of a directory the replica can read (HF names)."""

    replayable: ClassVar[bool] = True
    collective: ClassVar[bool] = False

    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    version: Optional[Annotated[int, Meta(ge=0)]] = None


class DistributedSource(msgspec.Struct, tag_field="type", tag="distributed", forbid_unknown_fields=True,
                        kw_only=True):
    """Tensors broadcast over the weight-update group `group_name` (see module docstring)."""

    replayable: ClassVar[bool] = False
    collective: ClassVar[bool] = True

    manifest: Manifest
    group_name: GroupName = DEFAULT_GROUP
    finish: Optional[bool] = None
    staging: Optional[Staging] = None
    packed_buffer_bytes: Optional[Annotated[int, Meta(ge=1, le=2**40)]] = None

    def __post_init__(self) -> None:
        if self.packed_buffer_bytes is not None and self.manifest.layout is not None:
            raise ValueError("a distributed source is either bucketed (a layout) or in vLLM's packed layout, not both")


class SharedMemorySource(msgspec.Struct, tag_field="type", tag="shared_memory", forbid_unknown_fields=True,
                         kw_only=True):
    """Buckets in shared memory on this host: a /dev/shm `segment`, or `cuda_ipc` (one per bucket)."""

    replayable: ClassVar[bool] = False
    collective: ClassVar[bool] = True

    manifest: Manifest
    segment: Optional[str] = None
    token: Optional[Annotated[int, Meta(ge=1, le=2**63 - 1)]] = None  # a segment's: marks this update's pieces
    piece_bytes: Annotated[int, Meta(ge=MIN_PIECE_BYTES, le=2**40, multiple_of=ALIGN)] = DEFAULT_PIECE_BYTES
    cuda_ipc: Optional[list[CudaIpcBuffer]] = None
    staging: Optional[Staging] = None

    def __post_init__(self) -> None:
        if (self.segment is None) == (self.cuda_ipc is None):
            raise ValueError("a shared-memory source names a segment or CUDA IPC buffers, exactly one of the two")
        if self.manifest.layout is None:
            raise ValueError("a shared-memory source needs a bucket layout in its manifest")
        if self.segment is not None:
            check_segment_name(self.segment)
            if self.token is None:
                raise ValueError("a shared-memory segment source needs the update's token")
        elif len(self.cuda_ipc) != len(self.manifest.layout.buckets):
            raise ValueError(f"{len(self.cuda_ipc)} CUDA IPC buffers for {len(self.manifest.layout.buckets)} buckets")


class DeltaSource(msgspec.Struct, tag_field="type", tag="delta", forbid_unknown_fields=True, kw_only=True):
    """A delta update (see module docstring): its payload over the weight-update group
    `group_name`, or in the /dev/shm `segment` (published piece by piece under `token`)."""

    replayable: ClassVar[bool] = False
    collective: ClassVar[bool] = True

    delta: DeltaManifest
    full: Optional[DeltaManifest] = None  # for a replica not on `delta.base_version`: the same update in full
    group_name: Optional[GroupName] = None
    segment: Optional[str] = None
    token: Optional[Annotated[int, Meta(ge=1, le=2**63 - 1)]] = None
    piece_bytes: Annotated[int, Meta(ge=MIN_PIECE_BYTES, le=2**40, multiple_of=ALIGN)] = DEFAULT_PIECE_BYTES
    staging: Optional[Staging] = None

    def __post_init__(self) -> None:
        full = self.full
        if full is not None and (full.base_version is not None or full.payload_bytes != self.delta.payload_bytes
                                 or full.payload_checksum != self.delta.payload_checksum
                                 or full.version != self.delta.version):
            raise ValueError("a delta source's full manifest has no base and shares the delta's payload and version")
        if (self.group_name is None) == (self.segment is None):
            raise ValueError("a delta source names a weight-update group or a shared-memory segment, exactly one")
        if self.segment is not None:
            check_segment_name(self.segment)
            if self.token is None:
                raise ValueError("a delta source in a shared-memory segment needs the update's token")


class VersionSource(msgspec.Struct, tag_field="type", tag="version_only", forbid_unknown_fields=True, kw_only=True):
    """No bytes: the weights stay as they are and serve under `version` from now on (vLLM's and
    SGLang's `/update_weight_version`: the trainer names the weights it put in by other means)."""

    replayable: ClassVar[bool] = False
    collective: ClassVar[bool] = False

    version: Annotated[int, Meta(ge=0)]


WeightSource = Union[DiskSource, DistributedSource, SharedMemorySource, DeltaSource, VersionSource]


MAX_LORA_NAME = 256
LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_[AB]\.weight$")  # PEFT's names


class AdapterSource(msgspec.Struct, tag_field="type", tag="lora_adapter", forbid_unknown_fields=True,
                    kw_only=True):
    """LoRA adapter `name`'s tensors only (PEFT names, `base_model.model.<module>.lora_{A,B}.weight`,
    in the manifest of `payload`, whose version is the adapter's: None, the replica's next) and
    the config they need (`alpha`, `rslora`); `rank` and `target_modules` (the projection names it
    adapts, e.g. `q_proj`) are the trainer's word, checked against the tensors. `payload` is
    bucketed (a layout: checksums) and commits at once (no `finish`, no `staging`: an adapter is
    staged beside the live one, never over it)."""

    name: Annotated[str, Meta(min_length=1, max_length=MAX_LORA_NAME)]
    rank: Annotated[int, Meta(ge=1, le=2**16)]
    alpha: Annotated[float, Meta(gt=0)]
    rslora: bool = False
    target_modules: Annotated[list[Annotated[str, Meta(min_length=1, max_length=128)]], Meta(max_length=64)]
    payload: Union[DistributedSource, SharedMemorySource]

    def __post_init__(self) -> None:
        payload = self.payload
        if payload.manifest.layout is None:
            raise ValueError("an adapter source's payload is bucketed (its manifest has a layout: checksums)")
        if isinstance(payload, DistributedSource) and payload.finish is not None:
            raise ValueError("an adapter source commits at once: its distributed payload has no finish")
        if payload.staging is not None:
            raise ValueError("an adapter source has no staging: a new version is staged beside the live one")
        bad = [n for n in payload.manifest.names if LORA_KEY.match(n) is None]
        if bad:
            raise ManifestError(f"an adapter source carries LoRA A/B weights only, not {bad[:4]}")


def source_version(source: WeightSource) -> Optional[int]:
    """The version `source` says its update commits under (None: the replica's next)."""
    if isinstance(source, (DiskSource, VersionSource)):
        return source.version
    if isinstance(source, DeltaSource):
        return source.delta.version
    return source.manifest.version


def with_version(source: WeightSource, version: Optional[int]) -> WeightSource:
    """`source` committing under `version` (None: as it says); refused if it says another one."""
    have = source_version(source)
    if version is None or version == have:
        return source
    if have is not None:
        raise ManifestError(f"version {version} contradicts the source's own version {have}")
    if isinstance(source, DiskSource):
        return msgspec.structs.replace(source, version=version)
    return msgspec.structs.replace(source, manifest=msgspec.structs.replace(source.manifest, version=version))


# NOTE: built once at import: msgspec builds a type's decoding info on first use, and two threads
# doing that at once (replicas' receivers in one process) crashed the interpreter
_PAYLOAD_DECODER = msgspec.msgpack.Decoder(SharedMemorySource)


def encode_tensor_payload(source: SharedMemorySource) -> bytes:
    """What `update_weights_from_tensor(serialized_named_tensors=[...])` takes: msgpack, not pickle."""
    return msgspec.msgpack.encode(source)


_PICKLE_MARKERS = (b"\x80",)  # every pickle protocol >= 2 starts with PROTO (0x80)


def decode_tensor_payload(data: bytes | str) -> SharedMemorySource:
    """The shared-memory source in one `serialized_named_tensors` entry (bytes, or base64 text as
    SGLang's HTTP clients send it). A pickled payload is refused: it could run code on decode."""
    if isinstance(data, str):
        import base64
        import binascii

        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ManifestError("serialized_named_tensors: text that is not base64") from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError(f"serialized_named_tensors: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_PAYLOAD_BYTES:
        raise ManifestError(f"serialized_named_tensors: {len(data)} bytes, over {MAX_PAYLOAD_BYTES}")
    if data.startswith(_PICKLE_MARKERS):
        raise ManifestError("serialized_named_tensors: a pickled payload (SGLang's MultiprocessingSerializer) is "
                            "refused, since unpickling runs arbitrary code; send weight_sync's msgpack shared-memory "
                            "handle instead (WeightSender with Transport.SHM, or encode_tensor_payload)")
    try:
        return _PAYLOAD_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ManifestError(f"serialized_named_tensors: not a shared-memory handle: {exc}") from None
