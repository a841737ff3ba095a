#!/usr/bin/env bash
# The GPU check: one command, one GPU, under 8 minutes. Prints each figure as it is measured:
#   1. the megatron backend on CUDA (megatron DDP + distributed optimizer, bf16), a few GRPO steps;
#   2. the export of the trained weights as an HF snapshot;
#   3. a CUDA SGLang engine on the same model, a disk weight sync of that snapshot, the version read
#      back from the engine, and its greedy tokens against the trainer's.
#
#   benchmarks/gpu/check.sh                      # the tiny model (generated offline), the default
#   MODEL=tiny://qwen3 benchmarks/gpu/check.sh   # or any local HF directory of a supported family
#
# Exit status 0 when every check passed. Needs the project's environment (.venv) and one CUDA GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "check.sh: no nvidia-smi: this check needs a CUDA GPU" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec timeout --signal=TERM --kill-after=20 "${CHECK_TIMEOUT_S:-480}" \
  "$PYTHON" -P benchmarks/gpu/check.py --model "${MODEL:-tiny://llama?seed=0}" --steps "${STEPS:-4}" "$@"
