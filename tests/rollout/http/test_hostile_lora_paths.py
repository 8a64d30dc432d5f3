"""LoRA loads named by a hostile client, on a real `rollout serve --http --weights-root R` process:
a FIFO (or a device) in place of an adapter file is refused at once, never read (it used to block
the engine's loop forever: no client was answered, SIGTERM did not stop the server); a directory
outside `--weights-root` is refused on the server's own HTTP front as over ZMQ, with one message
whether or not it exists; and the server serves on."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from transformers import AutoModelForCausalLM

from tests.inference.lora.peft_adapters import save_adapter
from tests.rollout.http_util import MODEL, WAIT_S, http_server_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BOUND_S = 10.0  # a refusal comes at once; a blocked read would never come


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights-root")


@pytest.fixture(scope="module")
def server(model_dir, root):
    with http_server_process(model_dir, "--weights-root", str(root)) as proc:
        yield proc


@pytest.fixture(scope="module")
def adapter(model_dir, root):
    return save_adapter(AutoModelForCausalLM.from_pretrained(model_dir), root / "good", r=4, alpha=8,
                        targets=["q_proj", "v_proj"], seed=1, std=0.5)


def _load(web: httpx.Client, name: str, path) -> httpx.Response:
    start = time.monotonic()
    reply = web.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert time.monotonic() - start < BOUND_S
    return reply


def _serves(web: httpx.Client) -> None:
    reply = web.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3})
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize("swapped", ["adapter_model.safetensors", "adapter_config.json"])
def test_a_fifo_in_place_of_an_adapter_file_is_refused_at_once(server, adapter, root, swapped):
    directory = root / f"fifo-{swapped.split('.')[0]}"
    directory.mkdir()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        if name == swapped:
            os.mkfifo(directory / name)
        else:
            (directory / name).write_bytes((adapter / name).read_bytes())
    with httpx.Client(base_url=server.http_url, timeout=BOUND_S) as web:
        reply = _load(web, "fifo", directory)
        assert reply.status_code == 400 and "not a regular file" in reply.json()["error"]["message"], reply.text
        _serves(web)


def test_a_device_in_place_of_the_weights_is_refused(server, root):
    directory = root / "device"
    directory.mkdir()
    (directory / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    os.symlink("/dev/zero", directory / "adapter_model.safetensors")
    with httpx.Client(base_url=server.http_url, timeout=BOUND_S) as web:
        reply = _load(web, "zero", directory)
        assert reply.status_code == 400 and "not a regular file" in reply.text
        _serves(web)


def test_weights_root_binds_loads_on_the_servers_own_front_too(server, adapter, tmp_path):
    """`rollout serve --http`'s front calls the engine in process; it refuses what ZMQ refuses,
    in one message whether the path exists or not (nothing to probe the filesystem with)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    link = adapter.parent / "leads-out"
    link.symlink_to(outside)
    with httpx.Client(base_url=server.http_url, timeout=WAIT_S) as web:
        messages = []
        for path in (outside, tmp_path / "absent", link):
            reply = _load(web, "out", path)
            assert reply.status_code == 400, reply.text
            messages.append(reply.json()["error"]["message"].replace(str(path), "PATH"))
        assert messages[0] == messages[1] and "outside every --weights-root" in messages[0]
        assert "outside every --weights-root" in messages[2]  # a symlink inside that leads out
        assert _load(web, "math", adapter).status_code == 200
        reply = web.post("/v1/completions", json={"model": "math", "prompt": [1, 2, 3], "max_tokens": 3})
        assert reply.status_code == 200
        assert web.post("/v1/unload_lora_adapter", json={"lora_name": "math"}).status_code == 200
        _serves(web)


def test_a_file_swapped_for_a_fifo_while_loads_run_never_blocks_the_server(server, adapter, root):
    """The race the old loader lost: a file checked by name, then opened again by name while a
    FIFO took its place. Each load here opens once and answers (loaded, or refused as not a
    regular file), however the swaps fall."""
    import threading

    directory = root / "swapping"
    directory.mkdir()
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    (directory / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    target, spare, fifo = (directory / "adapter_model.safetensors", directory / "spare", directory / "fifo")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            spare.write_bytes(weights)
            os.replace(spare, target)
            os.mkfifo(fifo)
            os.replace(fifo, target)
    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    try:
        with httpx.Client(base_url=server.http_url, timeout=BOUND_S) as web:
            codes = {_load(web, "swapped", directory).status_code for _ in range(30)}
            assert codes <= {200, 400}
    finally:
        stop.set()
        swapper.join(BOUND_S)
    with httpx.Client(base_url=server.http_url, timeout=WAIT_S) as web:
        web.post("/v1/unload_lora_adapter", json={"lora_name": "swapped"})
        _serves(web)
