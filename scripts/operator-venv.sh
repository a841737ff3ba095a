#!/usr/bin/env bash
# Builds the operator's own Python environment (requirements-operator.lock only: kopf, the Kubernetes
# client, pydantic, aiohttp, prometheus-client; no torch, SGLang or transformers), cached under
# ~/.cache/rlfleet/venv-operator-py<ver>-<hash of the lock>/ like the full environment of setup.sh,
# and prints its path. rlfleet itself is not installed into it: the operator image installs it with
# `pip install --no-deps .`; tests put the checkout's package on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${RLFLEET_CACHE:-$HOME/.cache/rlfleet}
PYTHON=${PYTHON:-python3}
pyver=$($PYTHON -c 'import sys; print("%d.%d" % sys.version_info[:2])')
lockhash=$( (cat requirements-operator.lock; echo "$pyver") | sha256sum | cut -c1-12)
venv="$CACHE/venv-operator-py$pyver-$lockhash"
if [ ! -f "$venv/.complete" ]; then
  echo "building the operator's Python environment in $venv" >&2
  rm -rf "$venv"
  mkdir -p "$CACHE"
  $PYTHON -m venv "$venv"
  # --no-deps: the lock is the whole closure; a missing pin fails the import check below.
  "$venv/bin/python" -m pip install --quiet --progress-bar off --no-deps -r requirements-operator.lock >&2
  "$venv/bin/python" -m pip check >&2
  "$venv/bin/python" -c 'import kopf, kubernetes_asyncio, pydantic, aiohttp, prometheus_client, yaml' \
    || { echo "operator-venv: the environment is incomplete" >&2; exit 1; }
  touch "$venv/.complete"
fi
echo "$venv"
