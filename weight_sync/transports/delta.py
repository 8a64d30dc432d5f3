"""The delta mode of the in-memory transports (gloo / NCCL broadcast, shared memory): the trainer
sends what changed since what it last sent (`weight_sync.delta_codec`), the replica applies it to
a copy of its live weights and commits only if the result hashes as the trainer's full weights.

One delta update, as a full one but with the payload in place of the buckets:

1. the replica checks the `DeltaSource` before a byte moves: its model (names, shapes, dtypes)
   and its base (its policy version is the delta's `base_version`); a replica on another base
   refuses (`BaseMismatchError`), in step with the group (`agree`), so nothing moves;
2. the payload travels as one opaque bucket (`DeltaManifest.carrier`): broadcast in pieces
   over the group (`bucket_broadcast`), or published piece by piece in a segment (`shm`), with
   the transport's checksums;
3. the changed tensors are rebuilt from the live weights and the changes straight into the
   update's staging buffers (one pass, `delta_codec.apply_change`); the full resulting weights
   (changed and unchanged tensors, in manifest order) are hashed (`weight_sync.weights_hash`)
   and compared with the trainer's hash; only once that matched, and (gloo) every replica
   agreed, are they loaded into the staged update (partial: unchanged tensors stay as they
   are) and committed.

Any failure aborts: the old weights keep serving, in place too (nothing is written before the
hash matched and the group agreed, so a trainer killed mid-delta leaves no replica mixed). The
sender then drops its base and sends a full update next (`WeightSender`, `delta=True`).

Where only some replicas of a group hold the base, the source carries a second manifest, `full`:
the same update with every tensor FULL, later in the same payload. Each replica picks its own (the
delta if it is on the base, else the full one), so one source, one broadcast or one segment serves
the whole group (a router forwards it unchanged to each replica), the group moves the model's
bytes once that sync, and every replica ends on the same weights.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from inference.errors import EngineStateError
from weight_sync.buckets import as_bytes, word_sum
from weight_sync.delta_codec import apply_delta, encode_delta, encode_mixed
from weight_sync.delta_manifest import PAYLOAD_NAME, BaseMismatchError, DeltaError, DeltaManifest
from weight_sync.manifest import ManifestError, check_against_model, dtype_name
from weight_sync.sources import DeltaSource
from weight_sync.transports import Transport
from weight_sync.transports.bucket_broadcast import receive_buckets, send_buckets
from weight_sync.transports.distributed import GroupError, WeightGroup
from weight_sync.transports.shm import SegmentPlan, fill_segment, read_segment
from weight_sync.weights_hash import weights_hash


class DeltaTransport:
    """`send` on the trainer (a `WeightSender` in delta mode, given the base it last sent),
    `receive` on a replica (a `WeightReceiver`)."""

    transports = ()  # NOTE: no `Transport` of its own: a delta rides the sender's gloo / nccl / shm
    source_type = DeltaSource

    def send(self, sender: Any, named: list[tuple[str, torch.Tensor]], version: int, policy: Any,
             base: Any, mixed: bool) -> int:
        """The delta from `base` (a `SentWeights`) to `named` (CPU tensors of the replica dtype),
        and with `mixed` (some replica is not on the base) the same weights in full later in the
        same payload, for those replicas (`DeltaManifest` module docstring); the payload bytes."""
        names, tensors = [n for n, _ in named], [t for _, t in named]
        if mixed:
            changes, full_changes, payload = encode_mixed(base.tensors, tensors)
        else:
            changes, payload = encode_delta(base.tensors, tensors)
            full_changes = None
        common = dict(names=names, dtypes=[dtype_name(t.dtype) for t in tensors],
                      shapes=[list(t.shape) for t in tensors], version=version,
                      weights_hash=weights_hash(names, tensors), payload_bytes=payload.numel(),
                      payload_checksum=word_sum(payload))
        delta = DeltaManifest(changes=changes, base_version=base.version, **common)
        full = DeltaManifest(changes=full_changes, base_version=None, **common) if full_changes else None
        carrier = delta.carrier()
        what = f"delta sync from version {base.version} to {version}"
        if sender.transport is Transport.SHM:
            plan = SegmentPlan.of(carrier, sender.piece_bytes)
            region = sender.regions.get(plan.segment_bytes)
            token = secrets.randbits(63) or 1
            source = DeltaSource(delta=delta, full=full, segment=region.name, token=token,
                                 piece_bytes=plan.piece_bytes)
            futures = sender.each(lambda t: t.update(source, policy))
            sender.move_then_collect(futures, what, lambda: fill_segment(region, plan, [payload.numpy()], token))
            return payload.numel()
        if sender.group is None or sender.group.broken is not None:
            sender.regroup()
        group = sender.group
        source = DeltaSource(delta=delta, full=full, group_name=sender.group_name)
        futures = sender.each(lambda t: t.update(source, policy))
        return sender.move_then_collect(futures, what, lambda: send_buckets(group, carrier,
                                                                            [payload.view(torch.float64)]))

    def receive(self, receiver: Any, source: DeltaSource, policy: Any) -> int:
        """Check, receive, apply, hash, commit (see module docstring); the new version."""
        group = receiver.group(source.group_name) if source.group_name is not None else None
        on_base = receiver.engine.policy_version == source.delta.base_version
        delta = source.delta if on_base or source.full is None else source.full  # NOTE: this replica's manifest
        try:
            naming = check_against_model(delta.model_manifest(), receiver.spec)
            live = _check_base(receiver, delta)
        except (ManifestError, KeyError, ValueError) as exc:
            _refuse(receiver, group, exc)
        rebuilt: dict[str, torch.Tensor] = {}

        def rebuild(payload: torch.Tensor) -> None:
            rebuilt.update(_rebuild(receiver, delta, live, payload))

        def load() -> None:
            if group is not None:
                receive_buckets(group, delta.carrier(), True, receiver.group_buffer,
                                lambda tensors: rebuild(as_bytes(tensors[PAYLOAD_NAME])))
            else:
                _read_payload(receiver, source, rebuild)
            # NOTE: only now, with the hash matched here (and, over a group, everywhere), is anything
            # loaded: an in-place replica whose trainer died mid-delta has written nothing
            receiver.load(rebuilt, naming)
            receiver.stats.bytes_received += delta.payload_bytes
        try:
            return receiver.staged(delta.version, source.staging, policy, load, partial=True)
        except GroupError:
            receiver.close_group(group.name)
            raise


def _check_base(receiver: Any, delta: DeltaManifest) -> dict[str, torch.Tensor]:
    """The live weights the delta applies to, if this replica holds its base as named tensors
    of the delta's dtypes; else `BaseMismatchError` (it needs a full sync)."""
    engine = receiver.engine
    if delta.base_version is not None and engine.policy_version != delta.base_version:
        raise BaseMismatchError(f"this replica is at version {engine.policy_version}, the delta applies to version "
                                f"{delta.base_version}: it needs a full sync")
    live = engine.model.named_tensors()
    dtype = dtype_name(receiver.spec.dtype)
    wrong = [n for n, d, s in zip(delta.names, delta.dtypes, delta.shapes)
             if n not in live or d != dtype or list(live[n].shape) != list(s)]
    if wrong:
        raise BaseMismatchError(f"this replica does not hold {wrong[:4]} as whole named {dtype} tensors (another "
                                "layout or dtype, or a share of each as an MoE rank keeps): it needs a full sync")
    return live


def _refuse(receiver: Any, group: WeightGroup | None, why: BaseException) -> None:
    """Say no in step with the sender (over a group), count the refusal, raise `why`."""
    if group is not None:
        try:
            group.agree(False)
        except GroupError:
            receiver.close_group(group.name)
    receiver.abort(why)
    raise why


def _read_payload(receiver: Any, source: DeltaSource, apply: Any) -> None:
    """The payload out of the sender's segment into the receiver's warm host buffer, then `apply(it)`."""
    delta = source.delta
    plan = SegmentPlan.of(delta.carrier(), source.piece_bytes)
    payload = receiver.host_buffer.get(delta.payload_bytes)[: delta.payload_bytes]
    read_segment(receiver.mappings, source.segment, plan, source.token, [payload.numpy()], receiver.timeout_s,
                 lambda bucket: None)
    apply(payload)


def _rebuild(receiver: Any, delta: DeltaManifest, live: dict[str, torch.Tensor],
             payload: torch.Tensor) -> dict[str, torch.Tensor]:
    """The changed tensors rebuilt from copies of the live ones (in the update's staging buffers
    where the engine hands them out), once the full result hashed as the trainer's; by name."""
    changed = delta.changed
    names = [delta.names[i] for i in changed]
    buffers: dict[str, torch.Tensor] = {}
    if receiver.engine.model.device.type == "cpu":
        try:
            buffers = receiver.engine.staging_buffers(names)
        except EngineStateError:  # NOTE: in place: the load copies into the live weights
            buffers = {}
    targets = {}
    for i, name in zip(changed, names):
        base = live[name].detach().cpu()  # NOTE: a GPU replica rebuilds on host (one copy each way)
        target = buffers.get(name)
        targets[i] = (target if target is not None else torch.empty_like(base), base)
    apply_delta(targets, delta.changes, payload.cpu())
    rebuilt = {i: target for i, (target, _) in targets.items()}
    result = [rebuilt[i] if i in rebuilt else live[name] for i, name in enumerate(delta.names)]
    got = weights_hash(delta.names, result)
    if got != delta.weights_hash:
        raise DeltaError(f"the weights this delta makes hash to {got.hex()}, the trainer's to "
                         f"{delta.weights_hash.hex()}: this replica's base is not the trainer's (or a piece was "
                         "lost); nothing was committed, and a full sync heals it")
    return {delta.names[i]: rebuilt[i] for i in changed}


__all__ = ["DeltaTransport"]
