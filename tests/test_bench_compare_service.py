"""bench/service/compare_service.py: its ratios point the documented way, and its driver serves a block of
each kind against this checkout (a server and a router over it, a few requests; no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "service" / "compare_service.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("compare_service", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_better_by_is_above_one_when_head_is_better():
    bench = load_bench()
    assert bench.better_by("p50_ms[server,1]", base=20.0, head=10.0) == 2.0  # head half the latency
    assert bench.better_by("tok_s[router,64]", base=100.0, head=150.0) == 1.5  # head more tokens/s


def test_figures_pool_every_call_of_the_blocks():
    bench = load_bench()
    blocks = [{"latencies": [0.010, 0.030], "tokens": 32, "wall": 0.5},
              {"latencies": [0.020], "tokens": 16, "wall": 0.5}]
    assert bench.figures_of(blocks, 64) == pytest.approx({"p50_ms": 20.0, "p99_ms": 30.0, "tok_s": 48.0})
    assert set(bench.figures_of(blocks, 1)) == {"p50_ms", "p99_ms"}


@pytest.mark.stress  # three processes and a router (~25-40 s on 2 cores): a bench's driver, run by `make stress`
def test_driver_serves_blocks_against_this_checkout(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    commands = "".join(json.dumps(block) + "\n" for block in (["server", 1], ["router", 1], ["router", 64])) + "quit\n"
    proc = subprocess.run([sys.executable, str(SCRIPT), "driver", "--model-dir", str(tmp_path / "model"),
                           "--single", "3", "--per-worker", "1"], cwd=ROOT, env=env, input=commands,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines.index("READY") < min(i for i, line in enumerate(lines) if line.startswith("RESULT "))
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    assert [len(r["latencies"]) for r in results[:3]] == [3, 3, 64]
    assert [r["tokens"] for r in results[:3]] == [3 * 16, 3 * 16, 64 * 16]
    assert all(v > 0 for r in results[:3] for v in r["latencies"])
    assert len(results[3]["digest"]) == 16
