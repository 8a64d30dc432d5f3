"""Suspend / resume with adapters loaded: the engine's own adapter tensors sleep with the weights
(moved to host at sleep levels 1 and 2, their storages emptied) and come back with them; a shared
adapter (the trainer's own parameters) stays where it is. Outputs after resume equal before."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.inference.lora.test_lora_share import greedy, make_engine, peft_of, read_by_forward
from tests.inference.models.dense.test_decoder_parity import tiny_hf

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def storages(adapter) -> dict[int, torch.UntypedStorage]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage()
            for layer in adapter.fused for blocks in layer.values()
            for a, _, parts in blocks for t in (a, *(bt for *_, bt in parts))}


@pytest.fixture
def loaded():
    base = tiny_hf("llama")
    engine = make_engine(copy.deepcopy(base))
    trainer = peft_of(base)
    engine.load_lora_from_peft("copied", trainer)
    engine.load_lora_from_peft("shared", trainer, share=True)
    adapters = {i.name: engine.core.loras.adapter(engine.core.loras.current(i.name).id) for i in engine.list_loras()}
    want = {name: greedy(engine, name).generated_token_ids for name in (None, "copied", "shared")}
    return base, engine, trainer, adapters, want


def test_adapters_go_to_host_with_the_weights_and_come_back(loaded):
    _, engine, trainer, adapters, want = loaded
    copied, shared = adapters["copied"], adapters["shared"]
    trainer_bytes = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                     for n, p in trainer.named_parameters() if "lora_" in n}
    before = engine.core.weights.model.named_tensors()  # NOTE: the base's own weights, for their byte count
    base_bytes = sum(s.nbytes() for s in {t.untyped_storage().data_ptr(): t.untyped_storage()
                                          for t in before.values()}.values())
    report = engine.suspend(offload_weights=True)
    # the copied adapter's forward tensors are emptied (to host), the shared one's are the trainer's, untouched
    assert all(s.nbytes() == 0 for s in storages(copied).values())
    assert read_by_forward(shared) <= set(trainer_bytes) and all(
        p.untyped_storage().nbytes() == trainer_bytes[p.untyped_storage().data_ptr()]
        for n, p in trainer.named_parameters() if "lora_" in n)
    assert report.offloaded_weight_bytes >= base_bytes + copied.nbytes
    assert engine.core.lora_offload.nbytes >= copied.nbytes
    engine.resume()
    assert engine.core.lora_offload.nbytes == 0 and all(s.nbytes() for s in storages(copied).values())
    assert {name: greedy(engine, name).generated_token_ids for name in want} == want


def test_level_two_discards_the_base_and_keeps_the_adapters_on_host(loaded):
    base, engine, _, adapters, want = loaded
    engine.suspend(discard_weights=True)
    assert all(s.nbytes() == 0 for s in storages(adapters["copied"]).values())
    engine.resume()
    engine.update_weights({n: t.detach().clone() for n, t in base.state_dict().items()})  # the base, sent again
    # the adapters came back on their own: an RL trainer re-sends an adapter only when it changes
    assert {name: greedy(engine, name).generated_token_ids for name in want} == want


def test_a_copied_adapter_owns_its_bytes(loaded):
    """A copy is a copy: no tensor of it is the trainer's (else a sleep would empty the trainer's
    parameters, and the trainer's next step would leak into a pinned version)."""
    _, _, trainer, adapters, _ = loaded
    own = {p.untyped_storage().data_ptr() for n, p in trainer.named_parameters() if "lora_" in n}
    held = {t.untyped_storage().data_ptr() for layer in adapters["copied"].layers for ab in layer.values() for t in ab}
    assert not held & own and not set(storages(adapters["copied"])) & own
