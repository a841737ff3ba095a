#!/usr/bin/env bash
# The GPU check: one command, under 8 minutes. Prints each figure as it is measured:
#   1. the megatron backend on CUDA (megatron DDP + distributed optimizer, bf16), a few GRPO steps; a
#      checkpoint (the distributed optimizer's state gathered) restored into a new trainer, both trained on;
#   2. the export of the trained weights as an HF snapshot;
#   3. a CUDA SGLang engine on the same model behind the router (the local fleet backend), a disk
#      weight sync of that snapshot, the version read back, its greedy tokens against the trainer's;
#   4. with 2 or more GPUs: a broadcast weight sync over NCCL (trainer and broadcast on GPU 0, the
#      engine on GPU 1), the served weights' checksum against the trainer's. With one GPU it says
#      that this was not run (NCCL needs a GPU per rank);
#   5. with 2 or more GPUs: megatron pipeline 2 and data parallel 2 on NCCL ranks against one rank, each
#      checkpointed across its ranks and restored mid-run (benchmarks/gpu/check_ranks.py).
#
#   benchmarks/gpu/check.sh                      # the tiny model (generated offline), the default
#   MODEL=tiny://qwen3 benchmarks/gpu/check.sh   # or any local HF directory of a supported family
#   benchmarks/gpu/check.sh --device cpu         # the same steps on CPU (gloo): a check of the check
#   PYTHON=python3 PYTHONPATH=$PWD benchmarks/gpu/check.sh --no-engine
#                          # an environment with torch and megatron-core but no SGLang: steps 1, 2, 5
#   benchmarks/gpu/check.sh --backend torch      # steps 1 to 4 with the torch backend
#
# Exit status 0 when every check passed. Needs the project's environment (.venv) and a CUDA GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [[ " $* " != *" --device cpu "* ]]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "check.sh: no nvidia-smi: this check needs a CUDA GPU (or --device cpu)" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
exec timeout --signal=TERM --kill-after=20 "${CHECK_TIMEOUT_S:-480}" \
  "$PYTHON" -P benchmarks/gpu/check.py --model "${MODEL:-tiny://llama?seed=0}" --steps "${STEPS:-4}" "$@"
