"""The dense decoder's blocks in one native call (`inference/models/dense/native_layers.py`) give the
Python blocks' bits: the same tokens and log-probs from the same seeded requests, through prefill
chunks (the last block narrowed to the sampled rows) and decode steps, with and without biases,
grouped-query attention; a model or step the C code does not take runs the Python blocks. Its one
new op, SwiGLU's activation, is torch's bits over every bf16 input, in every build this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams, native
from inference.models.dense import native_layers
from tests.inference.models.test_small_gemm import _x86_levels

needs_kernels = pytest.mark.skipif(not native.available(), reason="native kernels not built")
RUN = native_layers.run  # NOTE: the tests wrap it to count the steps it takes

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    # NOTE: a bias on every projection (q, k, v, o, gate, up, down) and an LM head of its own
    "llama-biases": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True,
                                                     "tie_word_embeddings": False}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),  # q, k, v biases only
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"use_sliding_window": False}),  # q/k norms: the Python blocks
}


def _model(name: str):
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **extra)).eval().to(torch.bfloat16)
    with torch.no_grad():  # NOTE: biases start at zero; random ones check that each is added where it belongs
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0, 0.5)
    return model


def _generate(model, enabled: bool, monkeypatch, max_rows: int = native_layers.MAX_ROWS,
              lengths=(40, 3, 17, 1, 29), max_batch_tokens: int = 48):
    """Seeded samples with their log-probs, and how many steps the native call took (decode-only,
    and with prefill rows)."""
    taken = {"decode": 0, "prefill": 0}
    run = RUN

    def counting(decoder, x, cos, sin, kv_cache, logits_indices):
        out = run(decoder, x, cos, sin, kv_cache, logits_indices)
        if out is not None:
            taken["decode" if logits_indices.numel() == x.shape[0] else "prefill"] += 1
            most_rows[0] = max(most_rows[0], x.shape[0])
        return out

    monkeypatch.setattr(native_layers, "ENABLED", enabled)
    monkeypatch.setattr(native_layers, "MAX_ROWS", max_rows)
    monkeypatch.setattr(native_layers, "run", counting)
    engine = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(
        block_size=8, num_blocks=256, max_requests=8, max_batch_tokens=max_batch_tokens, max_sequence_length=512))
    assert engine.model.spec.dtype == torch.bfloat16
    prompts = [[1] + [(7 * i + 13 * j) % 380 + 3 for j in range(length)] for i, length in enumerate(lengths)]
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=i, logprobs=2)
              for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    return [(o.generated_token_ids, o.logprobs) for o in outs], taken


most_rows = [0]  # the most rows of a step the native call took (`_generate`'s counting)


@needs_kernels
@pytest.mark.parametrize("name", ["llama", "llama-biases", "qwen2"])
def test_one_call_gives_the_python_blocks_bits(name, monkeypatch, one_torch_thread):
    model = _model(name)
    python, none = _generate(model, False, monkeypatch)
    native_, taken = _generate(model, True, monkeypatch)
    assert none == {"decode": 0, "prefill": 0}
    assert taken["decode"] > 0 and taken["prefill"] > 0  # NOTE: prefill chunks narrow the last block's rows
    assert native_ == python


@needs_kernels
def test_two_threads_give_the_same_bits(monkeypatch):
    model = _model("llama-biases")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        python, _ = _generate(model, False, monkeypatch)
        native_, taken = _generate(model, True, monkeypatch)
    finally:
        torch.set_num_threads(before)
    assert taken["decode"] > 0 and native_ == python


@needs_kernels
def test_what_the_call_does_not_take_runs_the_python_blocks(monkeypatch, one_torch_thread):
    qwen3 = _model("qwen3")  # NOTE: q and k normed per head: not in the C code
    python, _ = _generate(qwen3, False, monkeypatch)
    native_, taken = _generate(qwen3, True, monkeypatch)
    assert taken == {"decode": 0, "prefill": 0} and native_ == python
    llama = _model("llama")  # NOTE: steps of more rows than MAX_ROWS (here 4) go through Python
    python, _ = _generate(llama, False, monkeypatch)
    native_, taken = _generate(llama, True, monkeypatch, max_rows=4)
    full, all_taken = _generate(llama, True, monkeypatch)
    assert 0 < taken["decode"] + taken["prefill"] < all_taken["decode"] + all_taken["prefill"]
    assert native_ == python == full


@needs_kernels
def test_a_prefill_step_of_hundreds_of_rows_takes_the_call_with_the_python_blocks_bits(monkeypatch, one_torch_thread):
    model = _model("llama-biases")
    lengths, tokens = (300, 260, 9), 640  # NOTE: the first step's 570 prompt rows in one step
    python, _ = _generate(model, False, monkeypatch, lengths=lengths, max_batch_tokens=tokens)
    most_rows[0] = 0
    native_, taken = _generate(model, True, monkeypatch, lengths=lengths, max_batch_tokens=tokens)
    assert most_rows[0] > 512 and taken["prefill"] > 0 and native_ == python


def _every_bf16() -> torch.Tensor:
    return torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).clone()


def _libraries():
    return [None] + _x86_levels()


@needs_kernels
@pytest.mark.parametrize("level", _libraries())
def test_silu_mul_is_torch_s_bits_for_every_bf16_gate(level):
    lib = native.library() if level is None else native.library_at(level)
    gate = _every_bf16()
    for up in (torch.full_like(gate, 1.0), torch.full_like(gate, -7.5), gate.flip(0).clone()):
        want = F.silu(gate.clone(), inplace=True).mul_(up)
        got = gate.clone()
        assert lib.silu_mul_bf16(got.data_ptr(), up.data_ptr(), 1, got.numel(), got.numel(), 1) == 0
        nan = torch.isnan(want.float())
        assert torch.equal(torch.isnan(got.float()), nan)
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    # rows apart: the gate half of a [rows, 2 x cols] product, the up half beside it, 2 threads
    both = torch.randn(33, 2 * 700).mul(4).bfloat16()
    want = F.silu(both[:, :700].clone(), inplace=True).mul_(both[:, 700:])
    assert lib.silu_mul_bf16(both.data_ptr(), both[:, 700:].data_ptr(), 33, 700, 1400, 2) == 0
    assert torch.equal(both[:, :700].view(torch.int16), want.view(torch.int16))


@needs_kernels
def test_a_bad_shape_is_refused():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert native.library().silu_mul_bf16(x.data_ptr(), x.data_ptr(), 4, 8, 4, 1) != 0  # stride < cols


@needs_kernels
def test_a_weight_written_in_place_or_pages_given_back_are_seen(monkeypatch, one_torch_thread):
    """The call's table of addresses is kept between steps: a weight written in place (a colocated
    trainer's step on an aliased tensor) is packed again, and KV pages handed back at suspend and
    allocated again at resume are where it writes."""
    monkeypatch.setattr(native_layers, "ENABLED", True)
    engine = DynamicInferenceEngine.from_pretrained(_model("llama-biases"), InferenceConfig(
        block_size=8, num_blocks=64, max_requests=4, max_batch_tokens=64, max_sequence_length=128))
    prompts = [[1, 5, 9, 33, 70], [1, 200, 3]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)

    def both_paths():
        got = {}
        for enabled in (True, False):
            monkeypatch.setattr(native_layers, "ENABLED", enabled)
            engine.reset_prefix_cache()
            got[enabled] = [(o.generated_token_ids, o.logprobs) for o in engine.generate(prompts, params)]
        assert got[True] == got[False]
        return got[True]

    before = both_paths()
    with torch.no_grad():
        engine.model._layers[1].down_w.mul_(-3.0)
        engine.model._layers[0].q_b.add_(1.0)
    assert both_paths() != before
    engine.suspend()
    engine.resume()
    both_paths()
