"""A megatron-core GPTModel on CPU against the engine: logits parity, one training step, aliasing.

Every test builds a tiny GPTModel (fp32, local layer spec) with random weights, binds its
parameters to a `DenseDecoder` (views where the layout allows) and compares every logit row the
engine computes through its paged cache (chunked prefill and decode in one flat batch) with
megatron's own forward, computed in float64 (a float64 twin of the model's weights).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core", allow_module_level=True)

from inference.models.dense.decoder import DenseDecoder  # noqa: E402
from inference.models.spec import RopeKind, RopeSpec  # noqa: E402
from tests.reference import float64_everywhere  # noqa: E402
from tests.support.megatron_cpu import build_gpt_model, gpt_logits, megatron_cpu  # noqa: E402
from tests.weight_sync.paged import engine_logits, tiny_spec  # noqa: E402
from weight_sync.megatron.model import MEGATRON_ADAPTER, bind_megatron_model, spec_from_gpt_model  # noqa: E402
from weight_sync.megatron.names import megatron_to_hf  # noqa: E402

# NOTE: fp32 logits of magnitude < 6 (ulp 4.8e-7) after 2 layers of std-0.15 weights: measured max
# |engine - float64 megatron| 8.3e-6 over the CPU settings CI simulates (vs megatron's fp32: 6e-6); 1e-4 is 12x
TOL = 1e-4
SEQ_LEN = 20
PROMPT_LENS = (7, 1, 13)  # the rest of each sequence is decoded one token per step
VARIANTS = {
    "gqa": {},
    "mqa": {"num_kv_heads": 1},
    "mha": {"num_kv_heads": 4},
    "tied": {"tie_word_embeddings": True},
    "qwen2_qkv_bias": {"qkv_bias": True},
    "all_biases": {"qkv_bias": True, "o_bias": True, "mlp_bias": True},
    "qwen3_qk_norm": {"qk_norm": True, "num_heads": 6, "num_kv_heads": 3},
    "theta_eps": {"rope": RopeSpec(theta=1e6), "rms_norm_eps": 1e-5},
    "llama3_rope": {"rope": RopeSpec(theta=5e5, kind=RopeKind.LLAMA3, factor=8.0)},
    "linear_rope": {"rope": RopeSpec(theta=1e4, kind=RopeKind.LINEAR, factor=2.0)},
}


@pytest.fixture(autouse=True, scope="module")
def _megatron_on_cpu():
    # NOTE: tiny models: intra-op threads only add synchronisation on a shared CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with megatron_cpu(seed=0):
        yield
    torch.set_num_threads(threads)


def tiny_gpt(seed: int = 0, **overrides):
    model = build_gpt_model(tiny_spec(**overrides), seed=seed).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:  # std 0.15: peaked attention, so a wrong head order or mask shows in the logits
                p.normal_(0.0, 0.15)
    return model


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (len(PROMPT_LENS), SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def worst_diff(engine: DenseDecoder, model, ids: torch.Tensor) -> float:
    """Largest |engine - megatron| logit, megatron's forward computed in float64."""
    twin = build_gpt_model(spec_from_gpt_model(model)).double().eval()  # NOTE: megatron models do not deepcopy
    twin.load_state_dict(model.state_dict())
    with torch.no_grad(), float64_everywhere():
        ref = gpt_logits(twin, ids)
    got = engine_logits(engine, ids.tolist(), PROMPT_LENS, block_size=4, chunk=5)
    return max((g - r).abs().max().item() for g, r in zip(got, ref))


def qkv_names(spec) -> set[str]:
    return {n for n in spec.weight_shapes() if any(f"self_attn.{x}_proj" in n for x in "qkv")}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_matches_megatron_forward(variant):
    model = tiny_gpt(**VARIANTS[variant])
    spec = spec_from_gpt_model(model)
    assert spec == tiny_spec(family=spec.family, **VARIANTS[variant])
    binding = bind_megatron_model(model)
    engine = DenseDecoder(spec, binding)
    # q/k/v are copies exactly when the fused QKV interleaves several query groups
    assert set(binding.copied) == (qkv_names(spec) if spec.num_kv_heads > 1 else set())
    assert set(binding.aliased) | set(binding.copied) == set(spec.weight_shapes())
    assert worst_diff(engine, model, batch()) <= TOL


@pytest.mark.filterwarnings("ignore:.*tp_group is None:DeprecationWarning")
def test_qkv_and_fc1_split_match_megatrons_own_modules():
    model = tiny_gpt(seed=3, qkv_bias=True, num_heads=6, num_kv_heads=3)
    spec = spec_from_gpt_model(model)
    hf = megatron_to_hf(model.named_parameters(), spec)
    layer = model.decoder.layers[1]
    h = torch.randn(5, 2, spec.hidden_size)  # megatron's [seq, batch, hidden]
    with torch.no_grad():
        query, key, value = layer.self_attention.get_query_key_value_tensors(h)[:3]
        mlp_out, _ = layer.mlp(h)
    p = "model.layers.1."
    hf = {n: t.detach().double() for n, t in hf.items()}  # the split weights, computing in float64
    h64 = h.double()
    # NOTE: |q, k, v| < 5 from 64-term products, |mlp| < 5 through three: fp32 rounds each product by
    # ~sqrt(64) ulps of its terms' sum, ~1e-5; measured max 1.2e-6 (q, k, v) and 2.1e-6 (mlp), 8-10x under
    for got, x, heads in ((query, "q", spec.num_heads), (key, "k", spec.num_kv_heads), (value, "v", spec.num_kv_heads)):
        want = F.linear(h64, hf[f"{p}self_attn.{x}_proj.weight"], hf[f"{p}self_attn.{x}_proj.bias"])
        torch.testing.assert_close(got.double(), want.view(5, 2, heads, spec.head_dim), rtol=0, atol=1e-5)
    gate, up, down = (hf[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up", "down"))
    want = F.linear(F.silu(F.linear(h64, gate)) * F.linear(h64, up), down)
    torch.testing.assert_close(mlp_out.double(), want, rtol=0, atol=2e-5)


def train_one_step(model, seed: int = 1) -> None:
    ids = batch(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = gpt_logits(model, ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    model.eval()


@pytest.mark.parametrize("variant", ["gqa", "mqa", "tied"])
def test_one_training_step_then_parity(variant):
    model = tiny_gpt(seed=5, **VARIANTS[variant])
    spec = spec_from_gpt_model(model)
    binding = bind_megatron_model(model)
    engine = DenseDecoder(spec, binding)
    before = {n: t.clone() for n, t in binding.items()}
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    train_one_step(model)
    fresh = megatron_to_hf(model.named_parameters(), spec)
    for name in binding.aliased:  # views: the optimizer's in-place step is already visible
        assert binding[name].untyped_storage().data_ptr() in storages
        assert not torch.equal(binding[name], before[name]) and torch.equal(binding[name], fresh[name])
    for name in binding.copied:  # copies: stale until refreshed
        assert torch.equal(binding[name], before[name]) and not torch.equal(binding[name], fresh[name])
    binding.refresh()  # the fast in-place layout conversion; the engine is not re-bound
    assert all(torch.equal(binding[n], fresh[n]) for n in binding)
    assert all(t.data_ptr() == binding[n].data_ptr() for n, t in engine.named_tensors().items())
    assert worst_diff(engine, model, batch(2)) <= TOL

    # and the other path: re-map the updated parameters and re-bind them
    report = engine.bind_weights(megatron_to_hf(model.named_parameters(), spec), alias=True)
    assert not report.copied
    assert worst_diff(engine, model, batch(3)) <= TOL


def test_the_engine_adapter_converts_the_module_and_its_names():
    model = tiny_gpt()
    spec = spec_from_gpt_model(model)
    names = {n: p.detach() for n, p in model.named_parameters()}
    assert set(MEGATRON_ADAPTER.names_to_hf(names, spec)) == set(spec.weight_shapes())
    tensors = MEGATRON_ADAPTER.module_to_hf(model, spec)
    assert set(tensors) == set(spec.weight_shapes())
    other = tiny_spec(rms_norm_eps=1e-5)
    with pytest.raises(ValueError, match="rms_norm_eps"):
        MEGATRON_ADAPTER.module_to_hf(model, other)


def test_dtype_mismatch_is_copied_and_said():
    model = tiny_gpt()
    binding = bind_megatron_model(model, dtype=torch.bfloat16)
    assert not binding.aliased and all("dtype" in r or "interleaves" in r for r in binding.copied.values())
    assert all(t.dtype == torch.bfloat16 for t in binding.values())
