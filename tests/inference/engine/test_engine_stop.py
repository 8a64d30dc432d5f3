"""Stopping through the engine: any of several EOS ids (the model's `generation_config`), the
request's `stop_token_ids`, and `ignore_eos` overriding EOS but not the stop ids."""

from __future__ import annotations

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from tests.inference.engine.conftest import hf_greedy, random_prompts, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX = 12


def config() -> InferenceConfig:
    return InferenceConfig(block_size=4, num_blocks=64, max_requests=8, max_batch_tokens=64, max_sequence_length=64)


def stopped(run: list[int], stops: set[int]) -> list[int]:
    """`run` cut after its first token in `stops`."""
    return next((run[: i + 1] for i, tok in enumerate(run) if tok in stops), run)


@pytest.fixture(scope="module")
def setup():
    """A model whose generation_config lists three EOS ids, two of them sampled by greedy runs."""
    model = tiny_llama(seed=5)
    prompts = random_prompts(4, 5, 9, seed=51)
    runs = [hf_greedy(model, p, MAX) for p in prompts]
    # an EOS id that ends prompt 0's run at step 3, another that ends prompt 1's at step 5
    first, second = runs[0][3], next(t for t in runs[1][5:] if t != runs[0][3])
    eos = [2, first, second]
    model.generation_config.eos_token_id = eos
    return model, prompts, runs, set(eos)


def finish(engine, prompts, params):
    return engine.generate(prompts, params)


def test_any_generation_config_eos_id_stops_a_request(setup):
    model, prompts, runs, eos = setup
    assert set(DynamicInferenceEngine.from_pretrained(model, config()).core.eos_token_ids.tolist()) == eos
    outs = finish(DynamicInferenceEngine.from_pretrained(model, config()), prompts,
                  SamplingParams(temperature=0, max_tokens=MAX))
    ends = set()
    for run, out in zip(runs, outs):
        assert out.generated_token_ids == stopped(run, eos)
        expected = "stop" if len(out.generated_token_ids) < MAX or run[-1] in eos else "length"
        assert out.finish_reason.value == expected
        if expected == "stop":
            ends.add(out.generated_token_ids[-1])
    assert len(ends - {2}) >= 2  # two different EOS ids did stop requests


def test_eos_ids_from_a_saved_generation_config(setup, tmp_path):
    model, prompts, runs, eos = setup
    model.save_pretrained(tmp_path)  # writes generation_config.json with the list
    engine = DynamicInferenceEngine.from_pretrained(tmp_path, config())
    outs = finish(engine, prompts[:2], SamplingParams(temperature=0, max_tokens=MAX))
    assert [o.generated_token_ids for o in outs] == [stopped(r, eos) for r in runs[:2]]


def test_ignore_eos_runs_to_the_length_but_stop_ids_still_stop(setup):
    model, prompts, runs, eos = setup
    engine = DynamicInferenceEngine.from_pretrained(model, config())
    outs = finish(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    assert [o.generated_token_ids for o in outs] == runs
    assert {o.finish_reason.value for o in outs} == {"length"}
    stop_id = runs[2][4]
    outs = finish(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True,
                                                   stop_token_ids=[stop_id]))
    assert [o.generated_token_ids for o in outs] == [stopped(r, {stop_id}) for r in runs]
    outs = finish(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop_id]))
    assert [o.generated_token_ids for o in outs] == [stopped(r, eos | {stop_id}) for r in runs]
    assert outs[2].finish_reason.value == "stop"


@pytest.fixture
def planted_config_eos_only(monkeypatch):
    """Planted bug: the generation_config's EOS ids are not read (only config.json's one)."""
    monkeypatch.setattr("inference.models.loading._module_generation_eos", lambda model: ())


def test_the_eos_check_catches_a_missed_generation_config(setup, planted_config_eos_only):
    with pytest.raises(AssertionError):
        test_any_generation_config_eos_id_stops_a_request(setup)
