#!/usr/bin/env bash
# Weight sync on a CUDA machine (issue 15), run once from the repository root:
#
#   bash scripts/gpu_weight_sync.sh        # a few minutes; PY=/path/to/python to choose the interpreter
#
# 1. the gpu-marked tests: CUDA IPC buckets into a `rollout serve --device cuda` replica (equal to a
#    fresh engine; a corrupted bucket aborts), gloo into a GPU replica, NCCL broadcast to a replica
#    on a second GPU (skipped with one GPU: NCCL refuses two ranks on one device);
# 2. bench/weights/weight_transfer.py on the GPU: GB/s of CUDA IPC (shm), gloo and NCCL syncs of 100M (fp32) and
#    1B (bf16) random parameters into one replica, next to a device-to-device copy of the same bytes.
# Every step is bounded by `timeout`; the exit status is the first failure's.
set -euo pipefail
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export WANDB_MODE=offline

"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device: nothing to check here"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
      f"{torch.cuda.get_device_name(0)}", flush=True)
PYEOF
timeout 300 "$PY" -m pytest -q -m gpu -rs tests/weight_sync/test_gpu.py
timeout 420 "$PY" bench/weights/weight_transfer.py --device cuda --sizes 100M,1B --replicas 1 --repeats 3 \
    --transports shm,gloo,nccl
