"""Disk updates read regular files inside the named directory only, within the receiver's
`DiskAccess`, and refuse everything else with a `CheckpointError` (a ValueError) that leaves the
engine's weights and version as they were. Real files, symlinks and directories; an in-process
receiver on a tiny Llama."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.weight_sync.local import engine_of, tiny_llama
from weight_sync import CheckpointError, DiskAccess, DiskAccessError, DiskSource, WeightReceiver
from weight_sync.transports import disk


@pytest.fixture(scope="module")
def receiver():
    receiver = WeightReceiver(engine_of(tiny_llama(seed=0)), timeout_s=10.0)
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def weights():
    return {n: p.detach().clone() for n, p in tiny_llama(seed=1).named_parameters()}


def save_plain(directory, weights, name="model.safetensors"):
    """A plain HF checkpoint (no manifest): one safetensors file."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / name))
    return directory


def refused(receiver, path, match, error=CheckpointError, access=None):
    """`update(path)` is refused with `error` matching `match`; nothing changed."""
    before = receiver.engine.policy_version, receiver.stats.updates_committed
    saved = receiver.disk_access
    receiver.disk_access = access if access is not None else saved
    try:
        with pytest.raises(error, match=match) as caught:
            receiver.update(DiskSource(path=str(path)))
    finally:
        receiver.disk_access = saved
    assert (receiver.engine.policy_version, receiver.stats.updates_committed) == before
    return str(caught.value)


def test_a_symlinked_weights_file_that_leaves_the_directory_is_refused(receiver, weights, tmp_path):
    outside = save_plain(tmp_path / "outside", weights)
    inside = tmp_path / "ckpt"
    inside.mkdir()
    (inside / "model.safetensors").symlink_to(outside / "model.safetensors")
    refused(receiver, inside, "model.safetensors is not a regular file")


def test_index_entries_that_leave_the_directory_are_refused(receiver, weights, tmp_path):
    save_plain(tmp_path / "outside", weights)
    for entry in ("../outside/model.safetensors", "/etc/passwd", str(tmp_path / "outside" / "model.safetensors")):
        ckpt = tmp_path / f"ckpt{len(entry)}"
        ckpt.mkdir()
        (ckpt / disk.INDEX_FILE).write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": entry}}))
        refused(receiver, ckpt, "is not a file name in the directory")


def test_absent_not_a_directory_unreadable_and_empty_get_one_and_the_same_message(receiver, tmp_path):
    (tmp_path / "a-file").write_bytes(b"not a directory")
    (tmp_path / "empty").mkdir()
    (tmp_path / "other-files").mkdir()
    (tmp_path / "other-files" / "config.json").write_text("{}")
    paths = ["/nonexistent/ckpt", tmp_path / "a-file", tmp_path / "empty", tmp_path / "other-files",
             "/etc" if os.path.isdir("/etc") else tmp_path]
    messages = {refused(receiver, p, "not a checkpoint directory").replace(str(p), "PATH") for p in paths}
    assert len(messages) == 1, messages


def test_a_corrupt_safetensors_header_is_the_requests_fault(receiver, weights, tmp_path):
    for i, data in enumerate([b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}", b"\xff" * 8 + b"{}",
                              b"\x02\x00", b"\x0b\x00\x00\x00\x00\x00\x00\x00" + b'{"x": "y"} ']):
        ckpt = tmp_path / f"bad{i}"
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_bytes(data)
        refused(receiver, ckpt, "not a safetensors file")
    ckpt = save_plain(tmp_path / "overrun", {"model.embed_tokens.weight": torch.zeros(4, 4)})
    raw = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(raw.replace(b"[0,64]", b"[0,99]"))
    refused(receiver, ckpt, "do not hold")


def test_a_checkpoint_outside_every_root_is_refused_and_one_inside_loads(receiver, weights, tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    save_plain(elsewhere / "v1", weights)
    access = DiskAccess.of([root], beyond_loopback=True)
    refused(receiver, elsewhere / "v1", "outside every --weights-root", DiskAccessError, access)
    refused(receiver, root / ".." / "elsewhere" / "v1", "outside every --weights-root", DiskAccessError, access)
    root.mkdir()
    (root / "link").symlink_to(elsewhere / "v1", target_is_directory=True)
    refused(receiver, root / "link", "outside every --weights-root", DiskAccessError, access)
    refused(receiver, root / "v1", "not a checkpoint directory", CheckpointError, access)
    save_plain(root / "v1", weights)
    receiver.disk_access = access
    try:
        version = receiver.update(DiskSource(path=str(root / "v1")))
    finally:
        receiver.disk_access = DiskAccess()
    assert version == receiver.engine.policy_version >= 1
    loaded = receiver.engine.model.named_tensors()
    assert torch.equal(loaded["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])


def test_beyond_loopback_without_a_root_disk_updates_are_off(receiver, weights, tmp_path):
    save_plain(tmp_path / "v1", weights)
    off = DiskAccess.of([], beyond_loopback=True)
    refused(receiver, tmp_path / "v1", "disk weight updates are off", DiskAccessError, off)
    assert DiskAccess.of([], beyond_loopback=False).anywhere


def test_the_serve_flags_choose_the_disk_access(tmp_path):
    import argparse

    from rollout.server.serve import add_serve_arguments, disk_access_of

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)

    def access(*argv):
        return disk_access_of(parser.parse_args(["--model", "m", *argv]))

    assert access().anywhere
    assert not access("--host", "0.0.0.0", "--token", "t").anywhere and not access("--host", "0.0.0.0").roots
    assert not access("--http", "0", "--http-host", "0.0.0.0").anywhere  # the HTTP front shares the receiver
    roots = access("--weights-root", str(tmp_path / "a"), "--weights-root", str(tmp_path / "b")).roots
    assert {tmp_path / "a", tmp_path / "b"} <= set(roots)
    with pytest.raises(DiskAccessError):
        access("--weights-root", str(tmp_path / "a")).check(tmp_path / "c", "c")


def test_reading_stops_at_the_updates_timeout(tmp_path):
    from weight_sync.transports.checkpoint_files import ANYWHERE, CheckpointDir
    from weight_sync.transports.safetensors_file import CHUNK_BYTES

    save_plain(tmp_path / "big", {"w": torch.zeros(CHUNK_BYTES // 4 + 1)})  # more than one chunk to read
    with CheckpointDir(tmp_path / "big", ANYWHERE, timeout_s=0.0) as directory:
        with pytest.raises(TimeoutError, match="longer than the update's timeout"):
            directory.read_tensors("model.safetensors")
    with CheckpointDir(tmp_path / "big", ANYWHERE, timeout_s=60.0) as directory:
        assert torch.equal(directory.read_tensors("model.safetensors")["w"], torch.zeros(CHUNK_BYTES // 4 + 1))


def test_a_tensor_at_an_odd_offset_reads_right(tmp_path):
    """The format does not promise alignment: a float32 two bytes into the data still reads as written."""
    from weight_sync.transports.checkpoint_files import ANYWHERE, CheckpointDir

    value = torch.tensor([1.5, -2.25], dtype=torch.float32)
    header = json.dumps({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}}).encode()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\x07\x09"
                                                          + value.numpy().tobytes())
    with CheckpointDir(tmp_path / "ckpt", ANYWHERE, timeout_s=10.0) as directory:
        tensors = directory.read_tensors("model.safetensors")
    assert tensors["a"].tolist() == [7, 9] and torch.equal(tensors["b"], value)
