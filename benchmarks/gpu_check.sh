#!/usr/bin/env bash
# The device check for the day a GPU machine is lent (`device` tool): what the cost model's
# mechanisms assume, measured against the catalog, and single-GPU training steps measured
# against `simulate`. About 5-8 minutes on one H100; results in benchmarks/out/gpu_check/.
# Runs as it finds the machine: its own torch (>= 2.9), this source tree on PYTHONPATH, no
# Ray, no Optuna, nothing installed. Never a test dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - <<'PY'
import importlib.util
import sys

missing = [m for m in ("torch", "numpy", "scipy", "networkx") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"error: gpu_check needs {', '.join(missing)}, which this Python does not have")
import torch

version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if version < (2, 9):
    sys.exit(f"error: gpu_check needs torch >= 2.9; this Python has {torch.__version__}")
PY
python benchmarks/gpu_check.py --device cuda "$@"
