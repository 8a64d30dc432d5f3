"""Moving one update over a weight-update group (`weight_sync.transports.distributed`).

One bucketed update, every rank in step (`send_buckets` / `receive_buckets`):

1. `agree`: all_reduce(MIN) of each rank's verdict on the manifest (the trainer's is 1), so a
   replica that refuses it (another model) stops every rank before a bucket moves;
2. each bucket broadcast from rank 0 in pieces (`plan_pieces`): slices of the trainer's tensors
   sent as they lie, received straight into the engine's staging buffers where the engine hands
   them out (`staging_buffers`), small tensors packed together; a receiver sums each piece
   while the next ones arrive. No copy on the trainer, none on a replica but the socket's;
3. `agree` again on each rank's verdict on its buckets (checksums, loads): all replicas commit,
   or none does.

Without a layout (SGLang's calls, vLLM's) only broadcasts happen, one per tensor in manifest
order (`send_tensors`; received by `weight_sync.transports.vllm_broadcast`), or vLLM's packed chunks.

`DistributedTransport` is the `gloo` / `nccl` transport: these steps, with the control calls that
tell each replica what comes (`send`), and a replica's side of them (`receive`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from weight_sync.buckets import as_bytes, fill_checksums, holds_all, manifest_for, unpack_bucket, word_sum
from weight_sync.manifest import (
    ChecksumError,
    Manifest,
    ManifestError,
    Naming,
    align,
    check_against_model,
    dtype_name,
)
from weight_sync.sources import DistributedSource
from weight_sync.transports import Transport, vllm_broadcast
from weight_sync.transports.distributed import PIPELINE_DEPTH, GroupError, ReceiveBuffer, RefusedError, WeightGroup

PIECE_BYTES = 32 * 2**20  # a broadcast: few of them (each has a fixed cost), the next one summed while one flies
SMALL_BYTES = 4 * 2**20  # tensors below this travel packed together (a broadcast costs ~1 ms more than its bytes)


@dataclass(slots=True)
class Piece:
    """One broadcast of a bucket: `spans` of tensor bytes (tensor index, first byte, end byte).
    One span travels as it lies, straight from the trainer's tensor into the replica's buffer;
    several (small tensors) are packed, each at an 8-byte boundary, zero-padded."""

    spans: list[tuple[int, int, int]]

    @property
    def packed(self) -> bool:
        return len(self.spans) > 1

    @property
    def nbytes(self) -> int:
        if not self.packed:
            _, lo, hi = self.spans[0]
            return hi - lo
        return sum(align(hi - lo, 8) for _, lo, hi in self.spans)


def plan_pieces(manifest: Manifest, piece_bytes: Optional[int] = None) -> list[list[Piece]]:
    """Each bucket's pieces, alike on every rank: a tensor of `SMALL_BYTES` or more in slices of
    at most `piece_bytes` (default `PIECE_BYTES`), runs of smaller ones packed up to it."""
    piece_bytes = piece_bytes or PIECE_BYTES
    layout = manifest.layout
    assert layout is not None
    sizes = manifest.tensor_bytes()
    out = []
    for bucket in layout.buckets:
        pieces: list[Piece] = []
        run: list[tuple[int, int, int]] = []
        run_bytes = 0
        for i in range(bucket.start, bucket.stop):
            if sizes[i] >= SMALL_BYTES:
                if run:
                    pieces.append(Piece(run))
                    run, run_bytes = [], 0
                pieces += [Piece([(i, lo, min(sizes[i], lo + piece_bytes))]) for lo in range(0, sizes[i], piece_bytes)]
                continue
            run.append((i, 0, sizes[i]))
            run_bytes += align(sizes[i], 8)
            if run_bytes >= piece_bytes:
                pieces.append(Piece(run))
                run, run_bytes = [], 0
        if run:
            pieces.append(Piece(run))
        out.append([p for p in pieces if p.nbytes])
    return out


class PieceScratch:
    """Buffers for packed pieces, one per piece that can be in flight, on the group's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots = [ReceiveBuffer(device) for _ in range(PIPELINE_DEPTH)]
        self.turn = 0

    def next(self, nbytes: int) -> torch.Tensor:
        slot = self.slots[self.turn % PIPELINE_DEPTH]
        self.turn += 1
        return slot.get(nbytes)[:nbytes]


def send_buckets(group: WeightGroup, manifest: Manifest, tensors: Sequence[torch.Tensor]) -> int:
    """Rank 0's side of one bucketed update (checksums already in the manifest); bytes sent.

    Raises `RefusedError` if a replica refused the manifest (nothing sent) or failed a bucket.
    """
    if not group.agree(True):
        raise RefusedError("a replica refused the manifest (its reply says why); no bucket was sent")
    sources = [as_bytes(t) for t in tensors]
    scratch = PieceScratch(group.device)
    sent = 0
    for pieces in plan_pieces(manifest):
        group.pipeline(wire_bytes(p, sources, scratch) for p in pieces)
        sent += sum(p.nbytes for p in pieces)
    if not group.agree(True):
        raise RefusedError("a replica failed a bucket (a checksum or a load; its reply says which): no replica "
                           "committed")
    return sent


def wire_bytes(piece: Piece, sources: Sequence[torch.Tensor], scratch: PieceScratch) -> torch.Tensor:
    """What rank 0 broadcasts for `piece` (`sources`: each tensor's bytes): a slice of the
    tensor itself when it lies whole on the group's device, else a packed scratch buffer."""
    i, lo, hi = piece.spans[0]
    if not piece.packed and sources[i].device == scratch.device:
        return sources[i][lo:hi]  # NOTE: no copy: the broadcast reads the trainer's tensor
    out, at = scratch.next(piece.nbytes), 0
    for i, lo, hi in piece.spans:
        out[at : at + hi - lo].copy_(sources[i][lo:hi])  # NOTE: copy_ moves host bytes to an NCCL device
        end = at + align(hi - lo, 8) if piece.packed else at + hi - lo
        out[at + hi - lo : end].zero_()
        at = end
    return out


def receive_buckets(group: WeightGroup, manifest: Manifest, accepted: bool, buffer: ReceiveBuffer,
                    load: Callable[[dict[str, torch.Tensor]], None],
                    direct: Optional[dict[str, torch.Tensor]] = None) -> int:
    """A replica's side of one bucketed update: each piece lands in `direct[name]` (buffers the
    engine owns, on the group's device) or else in a bucket buffer; `load` gets each bucket's
    tensors once its checksum matched. Returns the bytes received; raises the first failure
    (here or, via `agree`, at another rank), after staying in step with the others to the end."""
    layout = manifest.layout
    assert layout is not None
    if not group.agree(accepted):
        raise RefusedError("another replica refused the manifest" if accepted else "the manifest was refused")
    scratch = PieceScratch(group.device)
    failure: Optional[BaseException] = None
    received = 0
    direct = direct or {}
    for index, (bucket, pieces) in enumerate(zip(layout.buckets, plan_pieces(manifest))):
        buf = None if holds_all(direct, manifest, index) else buffer.get(bucket.nbytes)
        tensors = unpack_bucket(manifest, index, buf, direct)
        targets = {i: as_bytes(tensors[manifest.names[i]]) for i in range(bucket.start, bucket.stop)}
        checksum = _receive_bucket(group, pieces, targets, scratch)
        received += bucket.nbytes
        if failure is not None:
            continue  # NOTE: keep receiving, so the others are not left waiting for this rank
        if checksum != bucket.checksum:
            failure = ChecksumError(f"bucket {index} of {len(layout.buckets)} ({bucket.nbytes} bytes) arrived with "
                                    f"checksum {checksum:#x}, the manifest says {bucket.checksum:#x}")
            continue
        try:
            load(tensors)
        except Exception as exc:  # noqa: BLE001 (reported after the last bucket, in step with the others)
            failure = exc
    if not group.agree(failure is None):
        raise failure or RefusedError("another replica failed a bucket: no replica commits")
    return received


def _receive_bucket(group: WeightGroup, pieces: list[Piece], targets: dict[int, torch.Tensor],
                    scratch: PieceScratch) -> int:
    """Receive one bucket's pieces into `targets` (each tensor's bytes); their checksum."""
    total = 0

    def landing(piece: Piece) -> torch.Tensor:
        if piece.packed:
            return scratch.next(piece.nbytes)
        i, lo, hi = piece.spans[0]
        return targets[i][lo:hi]

    def arrived(k: int, data: torch.Tensor) -> None:
        nonlocal total
        total += word_sum(data)
        if pieces[k].packed:
            at = 0
            for i, lo, hi in pieces[k].spans:
                targets[i][lo:hi].copy_(data[at : at + hi - lo])
                at += align(hi - lo, 8)

    group.pipeline((landing(p) for p in pieces), arrived)
    return total % 2**64


def send_tensors(group: WeightGroup, tensors: Sequence[torch.Tensor]) -> int:
    """SGLang's way: one broadcast per tensor, in order, no checksum; bytes sent."""
    sent = 0
    for t in tensors:
        t = t.detach().to(group.device).contiguous()
        group.broadcast(t)
        sent += t.numel() * t.element_size()
    return sent


# ---- the transport: both sides of one update -----------------------------------------------------


class DistributedTransport:
    """`gloo` / `nccl`: the manifest to every replica (a `DistributedSource`), then the buckets
    broadcast over the sender's weight-update group. `send` on the trainer (a `WeightSender`),
    `receive` on a replica (a `WeightReceiver`, which owns the staged update and its groups)."""

    transports = (Transport.GLOO, Transport.NCCL)
    source_type = DistributedSource

    def send(self, sender: Any, named: list[tuple[str, torch.Tensor]], version: Optional[int], policy: Any, *,
             tell: Optional[Callable[[Any, DistributedSource], Any]] = None, what: Optional[str] = None) -> int:
        """The bytes moved; made (again) first: the group, when there is none or it broke.
        `tell(target, source)`: how each target hears of the update (default `update(source,
        policy)`; an adapter sync wraps the source in its own call)."""
        if sender.group is None or sender.group.broken is not None:
            sender.regroup()
        if sender.tensor_by_tensor and tell is None:
            return self._send_tensor_by_tensor(sender, named, version, policy)
        group = sender.group
        tensors = [t for _, t in named]
        manifest = manifest_for(named, bucket_bytes=sender.bucket_bytes, version=version)
        fill_checksums(manifest, tensors)  # NOTE: the manifest goes first, so its checksums are computed first
        source = DistributedSource(manifest=manifest, group_name=sender.group_name)
        tell = tell or (lambda t, s: t.update(s, policy))
        futures = sender.each(lambda t: tell(t, source))
        return sender.move_then_collect(futures, what or f"sync to version {version}",
                                        lambda: send_buckets(group, manifest, tensors))

    @staticmethod
    def _send_tensor_by_tensor(sender: Any, named: list[tuple[str, torch.Tensor]], version: int, policy: Any) -> int:
        sent = 0
        for i, (name, tensor) in enumerate(named):
            last = i == len(named) - 1
            manifest = Manifest(names=[name], dtypes=[dtype_name(tensor.dtype)], shapes=[list(tensor.shape)],
                                version=version)
            source = DistributedSource(manifest=manifest, group_name=sender.group_name, finish=last)
            futures = sender.each(lambda t, source=source: t.update(source, policy))
            sent += sender.move_then_collect(futures, f"tensor {name}",
                                             lambda t=tensor: send_tensors(sender.group, [t]))
        return sent

    def receive(self, receiver: Any, source: DistributedSource, policy: Any) -> Optional[int]:
        """Receive `source` over its group; the new version once committed, None while a sequence
        stays open (`finish` False, or None with tensors still missing)."""
        manifest = source.manifest
        opened = receiver.open_update()
        group = receiver.group(source.group_name)
        sequence = opened is not None or source.finish is False
        if not sequence and source.finish is None and not _whole_model(manifest, receiver.spec):
            sequence = True  # NOTE: SGLang's callers send part of the model per call, and no `finish`
        try:
            version = _sequence_version(manifest, opened, receiver.engine.policy_version)
            if manifest.names or not sequence:
                naming = check_against_model(manifest, receiver.spec, complete=not sequence)
            else:  # NOTE: no tensor: vLLM's start (opens a sequence) or finish (commits the open one)
                naming = Naming.HF
            accepted = None
        except (ManifestError, KeyError, ValueError) as exc:
            accepted = exc
        if accepted is not None:
            _refuse(receiver, group, source, accepted)
        start = time.perf_counter()
        try:
            if opened is None:
                # NOTE: no tensor and `finish` False is vLLM's start: the update waits for its finish
                held = source.finish is False and not manifest.names
                opened = receiver.begin(version, source.staging, source.group_name, held=held)
            elif opened.origin != source.group_name:
                raise ValueError(f"the open update came over group {opened.origin!r}, this call over "
                                 f"{source.group_name!r}")
            def load(named: dict[str, torch.Tensor]) -> None:
                receiver.load(named, naming)

            if manifest.layout is None:  # NOTE: vLLM's layout, packed or one tensor a broadcast (SGLang's too)
                received = vllm_broadcast.receive(group, manifest, source.packed_buffer_bytes, load)
            else:
                direct = receiver.staging_buffers(manifest, group.device)
                received = receive_buckets(group, manifest, True, receiver.group_buffer, load, direct)
            receiver.stats.bytes_received += received
            if source.finish is False or (source.finish is None and (opened.held or not receiver.complete())):
                receiver.keep_open(opened)
                return None
            return receiver.commit(policy, start)
        except BaseException as exc:
            receiver.abort(exc)
            if isinstance(exc, GroupError):
                receiver.close_group(source.group_name)
            raise


def _refuse(receiver: Any, group: WeightGroup, source: DistributedSource, why: BaseException) -> None:
    """Say no in step with the sender, so it is not left waiting, then raise `why`."""
    manifest = source.manifest
    try:
        if manifest.layout is not None:
            group.agree(False)
        else:  # NOTE: SGLang's and vLLM's calls have no handshake: drain the broadcasts it will send anyway
            vllm_broadcast.receive(group, manifest, source.packed_buffer_bytes, lambda named: None)
    except GroupError:
        receiver.close_group(group.name)
    receiver.abort(why)
    raise why


def _sequence_version(manifest: Manifest, opened: Any, current: int) -> Optional[int]:
    """The version of a call of a sequence: its manifest's, which a later call must not contradict
    (an update opened without one commits as `current + 1`, so a later call may name only that)."""
    if opened is None:
        return manifest.version
    if manifest.version is None:
        return opened.version
    if opened.version is None:
        if manifest.version != current + 1:
            raise ManifestError(f"version {manifest.version}: the open update was begun without a version, so it "
                                f"commits as {current + 1}, the next one")
        return opened.version
    if manifest.version != opened.version:
        raise ManifestError(f"this call's manifest says version {manifest.version}, the open update's is "
                            f"{opened.version}")
    return manifest.version


def _whole_model(manifest: Manifest, spec: Any) -> bool:
    try:
        check_against_model(manifest, spec, complete=True)
    except (ManifestError, KeyError, ValueError):
        return False
    return True
