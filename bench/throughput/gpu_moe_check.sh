#!/usr/bin/env bash
# The GPU parts of issue 18 in one run (a few minutes on one GPU): the gpu-marked CUDA-graph tests
# (replay = eager, suspend/resume without growth, updates keep graphs, rebind re-captures) and
# bench/throughput/cuda_graphs.py. Without CUDA the tests skip and the benchmark says so; exit status 0.
# Usage, from the repo root: bash bench/throughput/gpu_moe_check.sh [python]
set -euo pipefail
PY=${1:-${PYTHON:-python}}
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PY'
import torch
print("CUDA:", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PY
"$PY" -m pytest -q -m gpu tests/inference/runner/test_cuda_graphs.py -p no:cacheprovider
"$PY" bench/throughput/cuda_graphs.py --requests 32 --tokens 64
