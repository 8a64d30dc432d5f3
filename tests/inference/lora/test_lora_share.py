"""`load_lora_from_peft(..., share=True)`: the engine aliases a live PEFT model's LoRA tensors.

Zero copy: the engine's A and B are the PEFT parameters (same addresses), so a trainer's in-place
change is what the next forward reads, equal to HF + PEFT; a copy (`share=False`) keeps the old
adapter. Each reload is a new version whose prefix-cache blocks never match the last one's; a
reload under requests in flight is refused (they would read the new tensors: PIN cannot hold), as
is an adapter in another dtype than the engine's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.errors import LoRAInUseError, LoRALoadError
from tests.inference.lora.peft_adapters import ALL_LINEAR, greedy_with_logprobs
from tests.inference.models.dense.test_decoder_parity import tiny_hf

PROMPT = [5, 17, 99, 42, 7, 300, 12, 8, 77]  # two full blocks of 4: what the prefix cache can serve
STEPS = 6
TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def peft_of(base, *, dtype=torch.float32):
    torch.manual_seed(1)
    model = get_peft_model(copy.deepcopy(base),
                           LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR, init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    return model.to(dtype).eval()  # NOTE: after get_peft_model, which would upcast a bf16 adapter to fp32


def read_by_forward(adapter) -> set[int]:
    """The addresses of the tensors the engine's forward reads (`fused`, not `layers`)."""
    return {t.data_ptr() for layer in adapter.fused for blocks in layer.values()
            for a, _, parts in blocks for t in (a, *(bt for *_, bt in parts))}


def step_in_place(model, seed: int) -> None:
    """What an optimizer step does to the adapter: every LoRA tensor changes, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def make_engine(base) -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_pretrained(base, InferenceConfig(
        block_size=4, num_blocks=64, max_requests=4, max_batch_tokens=32, max_sequence_length=32,
        max_loras=2, max_lora_rank=8))


def greedy(engine, name: str):
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, lora_name=name)
    (out,) = engine.generate([PROMPT], params)
    return out


def assert_matches_peft(out, peft) -> None:
    tokens, logprobs = greedy_with_logprobs(peft, PROMPT, STEPS)
    assert out.generated_token_ids == tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < TOL


def test_shared_adapter_aliases_the_peft_parameters_and_follows_in_place_steps():
    base = tiny_hf("llama")
    peft = peft_of(base)
    engine = make_engine(base)
    shared = engine.load_lora_from_peft("shared", peft, share=True)
    copied = engine.load_lora_from_peft("copied", peft)
    adapter = engine.core.loras.adapter(shared.id)
    own = {p.data_ptr() for n, p in peft.named_parameters() if "lora_" in n}
    assert adapter.shared and len(own) == 7 * 2 * 2 and read_by_forward(adapter) == own  # zero copy
    assert not read_by_forward(engine.core.loras.adapter(copied.id)) & own
    before = greedy(engine, "shared")
    assert_matches_peft(before, peft)
    assert greedy(engine, "copied").generated_token_ids == before.generated_token_ids
    frozen = copy.deepcopy(peft)

    step_in_place(peft, seed=0)
    again = engine.load_lora_from_peft("shared", peft, share=True)  # the next version: bookkeeping only
    assert again.version == shared.version + 1 and read_by_forward(engine.core.loras.adapter(again.id)) == own
    after = greedy(engine, "shared")
    assert after.lora_version == again.version
    assert_matches_peft(after, peft)  # the engine read the trainer's new tensors
    assert after.generated_token_ids != before.generated_token_ids
    assert_matches_peft(greedy(engine, "copied"), frozen)  # a copy kept the adapter as it was


def test_a_new_version_never_hits_the_last_versions_prefix_blocks():
    base = tiny_hf("llama")
    peft = peft_of(base)
    engine = make_engine(base)
    engine.load_lora_from_peft("p", peft, share=True)
    greedy(engine, "p")
    assert greedy(engine, "p").cached_tokens == 8  # same version: the prompt's two full blocks are served
    step_in_place(peft, seed=1)
    engine.load_lora_from_peft("p", peft, share=True)
    fresh = greedy(engine, "p")
    assert fresh.cached_tokens == 0  # NOTE: blocks keyed by (name, version): none computed by the old one
    assert_matches_peft(fresh, peft)


def test_a_planted_key_without_the_adapter_version_is_served_stale_and_counted(monkeypatch):
    """Planted bug: blocks keyed by the adapter's name only. The next version's request is then
    served the old version's blocks, and `cross_version_prefix_hits` counts them (the loop's check)."""
    from inference.sched.context import DynamicInferenceContext

    chain_key_of = DynamicInferenceContext.chain_key_of

    def name_only(self, fields):
        version, salt, adapter, _ = fields
        return chain_key_of(self, (version, salt, adapter, None if adapter is None else 1))

    monkeypatch.setattr(DynamicInferenceContext, "chain_key_of", name_only)  # NOTE: every chain key is made there
    base = tiny_hf("llama")
    peft = peft_of(base)
    engine = make_engine(base)
    engine.load_lora_from_peft("p", peft, share=True)
    greedy(engine, "p")
    assert engine.stats()["cross_version_prefix_hits"] == 0
    step_in_place(peft, seed=1)
    engine.load_lora_from_peft("p", peft, share=True)
    assert greedy(engine, "p").cached_tokens == 8  # the bug: the old version's blocks served
    assert engine.stats()["cross_version_prefix_hits"] == 2  # ... and counted


def test_reloading_a_shared_adapter_under_requests_in_flight_is_refused():
    base = tiny_hf("llama")
    peft = peft_of(base)
    engine = make_engine(base)
    first = engine.load_lora_from_peft("p", peft, share=True)
    stream = engine.submit(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, lora_name="p"))
    engine.step()
    with pytest.raises(LoRAInUseError, match="shared with the trainer"):
        engine.load_lora_from_peft("p", peft, share=True)
    while engine.has_unfinished_requests():
        engine.step()
    assert stream.result(5)[0].lora_version == first.version
    assert engine.load_lora_from_peft("p", peft, share=True).version == first.version + 1


def test_sharing_an_adapter_of_another_dtype_is_refused_and_a_copy_is_not():
    base = tiny_hf("llama")
    engine = make_engine(base)
    bf16 = peft_of(base, dtype=torch.bfloat16)
    with pytest.raises(LoRALoadError, match="aliasing needs both equal"):
        engine.load_lora_from_peft("p", bf16, share=True)
    assert engine.list_loras() == []
    assert engine.load_lora_from_peft("p", bf16).version == 1  # share=False casts (a copy)
