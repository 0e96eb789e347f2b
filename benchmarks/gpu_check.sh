#!/usr/bin/env bash
# The device check of issue 18, for the day a GPU machine is lent (`device` tool): CUDA paths,
# the bf16 matmul curve, a profiled cluster file, and measured vs simulated step time and
# memory for GPT-2-small-shaped strategies. About 5-8 minutes on one GPU; results in
# benchmarks/out/gpu_check/. Never a test dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import piper" 2>/dev/null; then
  pip install -q torch==2.13.0 && pip install -q -e ".[dev]"
fi
python benchmarks/gpu_check.py --device cuda "$@"
