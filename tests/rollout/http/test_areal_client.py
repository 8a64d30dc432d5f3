"""AReaL's own remote SGLang client drives `rollout serve --http` unchanged (bench/clients/areal_client_check.py);
AReaL lives in its own venv (skipped, naming it, without it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.stress
BENCH = Path(__file__).resolve().parents[3] / "bench" / "areal_client_check.py"
AREAL_PYTHON = Path("/tmp/areal-venv/bin/python")


def test_areals_client_generates_pauses_offloads_and_loads_weights():
    if not AREAL_PYTHON.exists():
        pytest.skip(f"no AReaL venv at {AREAL_PYTHON}; its set-up is in {BENCH.name}'s docstring")
    spec = importlib.util.spec_from_file_location("areal_client_check", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--areal-python", str(AREAL_PYTHON)]) == 0
