"""Metric names are API: one module defines them, all follow the naming rules."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from rlfleet.observability import metrics


def defined_metrics():
    return {name: value for name, value in vars(metrics).items() if isinstance(value, (Counter, Gauge, Histogram))}


def test_names_follow_the_rules():
    found = defined_metrics()
    assert found, "rlfleet.observability.metrics defines no metric"
    for attribute, metric in found.items():
        name = metric._name
        assert name.startswith("rlfleet_"), attribute
        if isinstance(metric, Counter):
            # prometheus_client strips _total from the base name and adds it back on export.
            assert not name.endswith("_total"), attribute
        if isinstance(metric, Histogram):
            assert name.endswith("_seconds"), attribute


def test_orchestrator_metrics_are_exported():
    names = {metric.describe()[0].name for metric in defined_metrics().values()}
    for expected in ("rlfleet_engine_state", "rlfleet_engine_probes", "rlfleet_engine_probe_failures",
                     "rlfleet_engines_marked_dead", "rlfleet_engine_recreations", "rlfleet_recovery_duration_seconds",
                     "rlfleet_weight_sync_duration_seconds", "rlfleet_engine_weight_version",
                     "rlfleet_router_membership_changes"):
        assert expected in names


def test_version_number():
    assert metrics.version_number("12") == 12
    assert metrics.version_number("default") == -1
    assert metrics.version_number(None) == -1
