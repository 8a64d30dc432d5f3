"""A served engine (`rollout serve --weights-root ROOT`, a real process) refuses disk updates it
must not read, at once and as the request's fault, and answers health throughout: a FIFO in
place of the weights file (whose open would block the reading thread, with the GIL, until
someone writes), a directory outside ROOT; a real checkpoint under ROOT still loads."""

from __future__ import annotations

import os

import pytest

from rollout import RolloutClient, ServerProcess
from rollout.wire.codec import ProtocolError
from rollout.wire.kinds import ErrorCode
from tests.rollout.service_util import SERVER_ARGS, save_tiny_model

CALL_S = 10.0  # every call's bound; a refusal comes at once, a frozen server not at all
HEALTH_S = 5.0
FIFOS = ("model.safetensors", "weight_sync_manifest.json", "model.safetensors.index.json")  # one directory each


def release(fifo) -> None:
    """Unblock a reader waiting in open() on `fifo` (a frozen server, so that it can be stopped)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # NOTE: ENXIO: nobody has it open for reading


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("disk")
    root = base / "root"
    model = save_tiny_model(root / "seed0", seed=0)
    save_tiny_model(base / "outside", seed=1)
    fifos = [root / f"fifo-{i}" / name for i, name in enumerate(FIFOS)]
    for fifo in fifos:
        fifo.parent.mkdir()
        os.mkfifo(fifo)
    with ServerProcess(model, *SERVER_ARGS, "--weights-root", str(root), "--weight-sync-timeout-s", "5") as proc:
        client = RolloutClient(proc.address, timeout=CALL_S)
        try:
            yield client, root, base
        finally:
            for fifo in fifos:
                release(fifo)
            client.close()


@pytest.mark.parametrize("index", range(len(FIFOS)), ids=FIFOS)
def test_a_fifo_in_a_checkpoint_is_refused_at_once_and_health_answers(served, index):
    client, root, _ = served
    with pytest.raises(ProtocolError) as caught:
        client.update_weights(str(root / f"fifo-{index}"), timeout=CALL_S)
    assert caught.value.code is ErrorCode.INVALID_REQUEST and "not a regular file" in caught.value.message
    assert client.health(timeout=HEALTH_S).healthy
    assert client.policy_version == 0


def test_outside_the_weights_root_is_refused_and_inside_it_loads(served):
    client, root, base = served
    with pytest.raises(ProtocolError) as caught:
        client.update_weights(str(base / "outside"), timeout=CALL_S)
    assert caught.value.code is ErrorCode.INVALID_REQUEST and "outside every --weights-root" in caught.value.message
    with pytest.raises(ProtocolError) as caught:
        client.update_weights(str(root / "absent"), timeout=CALL_S)
    assert caught.value.code is ErrorCode.INVALID_REQUEST and "not a checkpoint directory" in caught.value.message
    before = client.policy_version
    assert client.update_weights(str(root / "seed0"), timeout=CALL_S) == before + 1
    assert client.health(timeout=HEALTH_S).healthy


def test_lora_adapters_load_only_under_the_weights_root_and_serve_by_name(served):
    from transformers import AutoModelForCausalLM

    from inference import SamplingParams
    from tests.inference.lora.peft_adapters import save_adapter

    client, root, base = served
    hf = AutoModelForCausalLM.from_pretrained(root / "seed0")
    inside = save_adapter(hf, root / "lora", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1, std=0.5)
    outside = save_adapter(hf, base / "lora-outside", r=4, alpha=8, targets=["q_proj"], seed=2)
    with pytest.raises(ProtocolError) as caught:
        client.load_lora("out", outside, timeout=CALL_S)
    assert caught.value.code is ErrorCode.INVALID_REQUEST and "outside every --weights-root" in caught.value.message
    info = client.load_lora("math", inside, timeout=CALL_S)
    assert (info.name, info.version, info.rank) == ("math", 1, 4)
    assert [i.name for i in client.list_loras(timeout=CALL_S)] == ["math"]
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    batch = client.generate([[5, 6, 7, 8, 9]], 1, SamplingParams(**greedy), timeout=CALL_S)
    adapted = client.generate([[5, 6, 7, 8, 9]], 1, SamplingParams(**greedy, lora_name="math"), timeout=CALL_S)
    assert batch.rollouts[0].completion_ids != adapted.rollouts[0].completion_ids
    with pytest.raises(ProtocolError) as caught:
        client.generate([[5, 6, 7]], 1, SamplingParams(max_tokens=2, lora_name="nope"), timeout=CALL_S)
    assert caught.value.code is ErrorCode.NOT_FOUND
    client.unload_lora("math", timeout=CALL_S)
    assert client.list_loras(timeout=CALL_S) == []
    assert client.health(timeout=HEALTH_S).healthy
