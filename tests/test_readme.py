"""The README's Python snippets run as written (in order, sharing one namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
EXCERPTS = ("gpt_model", "start_ep_rank", "adapters/math", "sync_lora")  # need a trainer from elsewhere
# (megatron), several processes (expert parallelism), a trained PEFT adapter's directory or a served fleet:
# read, not run (the LoRA calls run in tests/inference/lora, the adapter sync in tests/weight_sync)
SLOW = ("grpo_step",)
HTTP = ("http_url",)  # SmolLM2 behind `rollout serve --http` (~15 s on 2 cores): run by `make stress`; the same
# calls run under `slow` in tests/rollout/http/test_http_smollm2.py
RAY = ("RayReplicas",)  # starts a local Ray instance (~15 s on 2 cores): run by `make stress`


def runnable(block: str) -> bool:
    return not any(word in block for word in EXCERPTS + RAY + HTTP)


def test_readme_has_snippets():
    assert len(BLOCKS) >= 4


def test_engine_snippets_run():
    namespace: dict = {}
    for block in BLOCKS:
        if runnable(block) and not any(word in block for word in SLOW):
            exec(compile(block, str(README), "exec"), namespace)


def colocated_block() -> str:
    (block,) = [b for b in BLOCKS if any(word in b for word in SLOW)]
    return block


def test_colocated_rl_snippet_runs_its_first_steps(capsys):
    """The snippet as written, its loop cut to 3 steps (the 200-step run learns: `make stress` below;
    `tests/rollout/rl/test_colocated.py::test_the_demo_learns` runs the same demo in `make test`)."""
    block = colocated_block()
    assert block.count("range(200)") == 1
    exec(compile(block.replace("range(200)", "range(3)"), str(README), "exec"), {})
    (line,) = capsys.readouterr().out.strip().splitlines()  # step 0's
    assert line.startswith("step   0  reward") and float(line.split("max")[1]) <= 1e-5


@pytest.mark.stress  # 200 steps, ~50 s on 2 cores
def test_colocated_rl_snippet_runs(capsys):
    exec(compile(colocated_block(), str(README), "exec"), {})
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert float(last.split("reward")[1].split()[0]) >= 0.9


@pytest.mark.stress
def test_http_snippet_runs():
    namespace: dict = {}
    exec("from rollout import ServerProcess", namespace)
    (block,) = [b for b in BLOCKS if any(word in b for word in HTTP)]
    exec(compile(block, str(README), "exec"), namespace)


@pytest.mark.stress
def test_ray_snippet_runs():
    pytest.importorskip("ray")
    namespace: dict = {}
    for block in BLOCKS:  # NOTE: after the blocks it builds on (model_dir, local, greedy)
        if runnable(block) and not any(word in block for word in SLOW):
            exec(compile(block, str(README), "exec"), namespace)
    (block,) = [b for b in BLOCKS if any(word in b for word in RAY)]
    exec(compile(block, str(README), "exec"), namespace)
