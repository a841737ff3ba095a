#!/usr/bin/env bash
# Creates the whole development environment from nothing; idempotent and cached.
#
# - Python: one heavy virtualenv with every pinned dependency (requirements.lock: SGLang, the router,
#   torch, transformers, megatron-core, kopf, ...) cached under ~/.cache/rlfleet/venv-<hash>/, and a
#   light .venv in the checkout that layers the project (editable) over it. A new clone reuses the
#   cached environment; a changed lock file builds a new one.
# - Binaries: etcd, kube-apiserver, kube-controller-manager, kubectl, helm, prometheus and promtool,
#   pinned and cached under ~/.cache/rlfleet/<name>-<version>/bin (scripts/build-binaries.sh); kubectl and
#   helm are linked into .venv/bin, so `source .venv/bin/activate` gives rlfleet, kubectl and helm.
# - The tiny model under ~/.cache/rlfleet/models/.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${RLFLEET_CACHE:-$HOME/.cache/rlfleet}
PYTHON=${PYTHON:-python3}
mkdir -p "$CACHE"
start=$(date +%s)
step() { printf '[setup %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

pyver=$($PYTHON -c 'import sys; print("%d.%d" % sys.version_info[:2])')
lockhash=$( (cat requirements.lock; echo "$pyver") | sha256sum | cut -c1-12)
heavy="$CACHE/venv-py$pyver-$lockhash"
if [ ! -f "$heavy/.complete" ]; then
  step "building the pinned Python environment in $heavy (SGLang brings ~11 GB of wheels; minutes)"
  rm -rf "$heavy"
  $PYTHON -m venv "$heavy"
  "$heavy/bin/python" -m pip install --progress-bar off -r requirements.lock 2>&1 | grep -vE '^(Requirement already|  (Using cached|Downloading|Obtaining))' | grep -E '^(Collecting|Successfully|ERROR)' | tail -n 3 || true
  "$heavy/bin/python" -c 'import sglang, sglang_router, torch, transformers, megatron.core, kopf' \
    || { echo "setup: the Python environment is incomplete (see pip output above)" >&2; exit 1; }
  touch "$heavy/.complete"
else
  step "Python environment cached: $heavy"
fi

if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.heavy 2>/dev/null)" != "$heavy" ]; then
  step "creating .venv over the cached environment"
  rm -rf .venv
  $PYTHON -m venv --without-pip .venv
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  heavysite=$("$heavy/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$heavysite')" > "$site/rlfleet-deps.pth"
  echo "$heavy" > .venv/.heavy
fi
# Linters and the type checker: small, pinned in requirements-dev.lock, cached apart from the heavy
# environment so that changing one does not rebuild the other; layered into .venv like it.
devhash=$( (cat requirements-dev.lock; echo "$pyver") | sha256sum | cut -c1-12)
devtools="$CACHE/devtools-py$pyver-$devhash"
if [ ! -f "$devtools/.complete" ]; then
  step "building the lint environment in $devtools"
  rm -rf "$devtools"
  $PYTHON -m venv "$devtools"
  "$devtools/bin/python" -m pip install --quiet --progress-bar off --no-deps -r requirements-dev.lock
  touch "$devtools/.complete"
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
devsite=$("$devtools/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$devsite')" > "$site/rlfleet-devtools.pth"
ln -sf "$devtools/bin/ruff" .venv/bin/ruff

# TensorBoard's event writer and reader and the W&B client (spec.tracking.tensorboard, spec.tracking.wandb):
# requirements-tracking.lock, installed without dependencies (everything else they need is
# requirements.lock's) and layered into .venv.
trackhash=$( (cat requirements-tracking.lock; echo "$pyver") | sha256sum | cut -c1-12)
tracking="$CACHE/tracking-py$pyver-$trackhash"
if [ ! -f "$tracking/.complete" ]; then
  step "building the tracking environment in $tracking"
  rm -rf "$tracking"
  "$heavy/bin/python" -m pip install --quiet --progress-bar off --no-deps --target "$tracking/site" \
    -r requirements-tracking.lock
  touch "$tracking/.complete"
fi
echo "import site; site.addsitedir('$tracking/site')" > "$site/rlfleet-tracking.pth"
# An MLflow tracking server for the tests and for local use (`mlflow server`): its own environment,
# never layered into .venv (rlfleet speaks MLflow's REST API over aiohttp); requirements-mlflow.lock
# is its whole pinned closure.
mlhash=$( (cat requirements-mlflow.lock; echo "$pyver") | sha256sum | cut -c1-12)
mlflowenv="$CACHE/mlflow-py$pyver-$mlhash"
if [ ! -f "$mlflowenv/.complete" ]; then
  step "building the MLflow server environment in $mlflowenv (~1 minute)"
  rm -rf "$mlflowenv"
  $PYTHON -m venv "$mlflowenv"
  "$mlflowenv/bin/python" -m pip install --quiet --progress-bar off --no-deps -r requirements-mlflow.lock
  "$mlflowenv/bin/mlflow" --version >/dev/null
  touch "$mlflowenv/.complete"
fi

step "installing rlfleet (editable) into .venv"
.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | grep -v '^$' || true

step "pinned binaries"
scripts/build-binaries.sh
# The README's cluster commands call kubectl and helm by name: `source .venv/bin/activate` puts them on
# PATH next to rlfleet.
for tool in kubectl helm; do
  ln -sf "$(.venv/bin/python -P -c "from rlfleet.util.binaries import tool_path; print(tool_path('$tool'))")" \
    ".venv/bin/$tool"
done

# tmux: the terminal-view test runs `rlfleet run` in a real terminal (a Debian package).
if ! command -v tmux >/dev/null; then
  step "installing tmux (Debian package)"
  apt-get install -y -qq tmux >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq tmux >/dev/null; }
fi

# jemalloc: CPU engines preload it, so a broadcast weight update's receive buffers reuse pages instead of
# faulting fresh ones in every sync (rlfleet/util/allocator.py; a Debian package).
if [ ! -f /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 ] && [ ! -f /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 ]; then
  step "installing jemalloc (Debian package)"
  apt-get install -y -qq libjemalloc2 >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq libjemalloc2 >/dev/null; } \
    || echo "setup: could not install libjemalloc2; CPU engines receive broadcast weight updates slower without it" >&2
fi

step "tiny model"
.venv/bin/python -m rlfleet.trainer.tiny "$CACHE/models/tiny-llama-seed0" --seed 0 --if-missing >/dev/null

# Headless Chromium (Debian package) opens the run report in its test (tests/integration/test_report.py).
if ! command -v chromium >/dev/null 2>&1; then
  step "installing chromium (apt-get)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
    >/dev/null 2>&1 || echo "setup: could not install chromium; the report's browser test fails without it" >&2
fi

step "done. Activate with: source .venv/bin/activate"
