"""Every Prometheus metric rlfleet exports, defined once (the names are API).

Prefix `rlfleet_`; counters end in `_total`; durations are histograms in `_seconds`. Dashboards and
alert rules may only query names defined here. All metrics live in REGISTRY (the process default
registry, which `prometheus_client.start_http_server` serves); add new ones to this module.
"""
from __future__ import annotations

from prometheus_client import REGISTRY as _DEFAULT_REGISTRY
from prometheus_client import Counter, Gauge, Histogram

REGISTRY = _DEFAULT_REGISTRY

DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

# --- Engines: state, health probes, deaths, recreation ----------------------------------------------
# 1 for the slot's current state (starting, alive, dead, failed, stopped), 0 for the others.
ENGINE_STATE = Gauge(
    "rlfleet_engine_state", "Engine slot state (1 = current).", ["fleet", "slot", "state"], registry=REGISTRY
)
ENGINE_PROBES = Counter(
    "rlfleet_engine_probes_total", "Health probes (GET /health_generate) by result.", ["fleet", "result"],
    registry=REGISTRY,
)
# kind: connection_refused, timeout, connection_closed, unavailable, client_error, server_error, ...
ENGINE_PROBE_FAILURES = Counter(
    "rlfleet_engine_probe_failures_total", "Failed health probes by failure kind.", ["fleet", "kind"],
    registry=REGISTRY,
)
# reason: exited, probe_failed, startup_failed, startup_timeout, load_failed, unreachable, requested
ENGINES_MARKED_DEAD = Counter(
    "rlfleet_engines_marked_dead_total", "Engines marked dead by reason.", ["fleet", "reason"], registry=REGISTRY
)
ENGINE_RECREATIONS = Counter(
    "rlfleet_engine_recreations_total", "Engine slots recreated after a death.", ["fleet"], registry=REGISTRY
)
ENGINE_RESTARTS = Gauge(
    "rlfleet_engine_restarts", "Recreations of the slot so far in this run.", ["fleet", "slot"], registry=REGISTRY
)
RECOVERY_DURATION = Histogram(
    "rlfleet_recovery_duration_seconds", "Time from recreating dead slots to all slots alive.", ["fleet"],
    buckets=DURATION_BUCKETS, registry=REGISTRY,
)

# --- Weights ----------------------------------------------------------------------------------------
WEIGHT_SYNC_DURATION = Histogram(
    "rlfleet_weight_sync_duration_seconds", "Whole weight sync (validate, recover, load, read back).",
    ["fleet", "outcome"], buckets=DURATION_BUCKETS, registry=REGISTRY,
)
WEIGHT_SYNCS = Counter(
    "rlfleet_weight_syncs_total", "Weight syncs by outcome (ok, degraded, invalid_snapshot, failed).",
    ["fleet", "outcome"], registry=REGISTRY,
)
# The numeric step of the version read back from the engine (-1 when the label is not a number).
ENGINE_WEIGHT_VERSION = Gauge(
    "rlfleet_engine_weight_version", "Weight version (step) read back from the engine.", ["fleet", "slot"],
    registry=REGISTRY,
)
ENGINE_WEIGHT_LOAD_DURATION = Histogram(
    "rlfleet_engine_weight_load_duration_seconds", "One engine's update_weights_from_disk call.", ["fleet"],
    buckets=DURATION_BUCKETS, registry=REGISTRY,
)

# --- Router membership ------------------------------------------------------------------------------
# change: add, remove
ROUTER_MEMBERSHIP_CHANGES = Counter(
    "rlfleet_router_membership_changes_total", "Workers added to or removed from the router.",
    ["fleet", "change"], registry=REGISTRY,
)
ROUTER_WORKERS = Gauge(
    "rlfleet_router_workers", "Workers the router listed at the last reconcile.", ["fleet"], registry=REGISTRY
)


def version_number(version: str | None) -> float:
    """The gauge value of a weight version label ("<step>"); -1 when it is not a number."""
    try:
        return float(version) if version is not None else -1.0
    except ValueError:
        return -1.0
