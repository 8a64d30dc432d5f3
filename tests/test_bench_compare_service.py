"""bench/compare_service.py: its ratios point the documented way, and its driver runs once against
this checkout (a server and a router over it, a few requests; no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "compare_service.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("compare_service", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_better_by_is_above_one_when_head_is_better():
    bench = load_bench()
    assert bench.better_by("p50_ms[server,1]", base=20.0, head=10.0) == 2.0  # head half the latency
    assert bench.better_by("tok_s[router,64]", base=100.0, head=150.0) == 1.5  # head more tokens/s


@pytest.mark.slow
def test_driver_runs_once_against_this_checkout(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, str(SCRIPT), "driver", "--model-dir", str(tmp_path / "model"),
                           "--single", "3", "--per-worker", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert set(result["figures"]) == {f"{stat}[{path},{inflight}]" for path in ("server", "router")
                                      for stat, inflight in (("p50_ms", 1), ("p99_ms", 1), ("p50_ms", 64),
                                                             ("p99_ms", 64), ("tok_s", 64))}
    assert all(v > 0 for v in result["figures"].values())
