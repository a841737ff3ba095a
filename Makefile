# The two commands of the README: `make quickstart` and `make test`. Both set up first (idempotent).
SHELL := /bin/bash
PY := .venv/bin/python
PYTEST := $(PY) -P -m pytest

.PHONY: setup test test-unit test-integration test-e2e quickstart crds dashboards docs bench lint clean

setup:
	scripts/setup.sh

# Two test workers at least, one per two cores on larger machines: most of the suite waits on engines,
# pods and timeouts, so on 2 cores two workers ran it in 51.2 min against 63.0 min in one process (the
# same machine, the same day). A cluster test, or a module's tests, stay on one worker
# (tests/conftest.py: worker_group). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= $(shell n=$$(nproc); w=$$((n / 2)); [ $$w -gt 2 ] && echo $$w || echo 2)

test: setup
	$(MAKE) --no-print-directory lint
	$(PYTEST) tests -n $(TEST_WORKERS) --dist loadgroup --durations=30

# ruff, mypy and the layer contract (scripts/check_layers.py); `make test` runs them first.
lint:
	.venv/bin/ruff check .
	$(PY) -m mypy
	$(PY) -P scripts/check_layers.py

test-unit: setup
	$(PYTEST) tests/unit

test-integration: setup
	$(PYTEST) tests/integration

test-e2e: setup
	$(PYTEST) tests/e2e

quickstart: setup
	.venv/bin/rlfleet run examples/quickstart.yaml

# The CRDs (crds/*.yaml) and the API reference (docs/api-reference.md), both from the models.
crds:
	$(PY) -m rlfleet.crds.generate

# The chart's Grafana dashboards (charts/rlfleet/dashboards/*.json), from rlfleet/observability/dashboards.
dashboards:
	$(PY) -m rlfleet.observability.dashboards

docs: crds

bench: setup
	for b in benchmarks/bench_*.py; do $(PY) -P $$b || exit 1; done

clean:
	rm -rf .venv build *.egg-info .pytest_cache
