"""PromQL built from the metric objects of rlfleet/observability/metrics.py (pure; no Grafana here).

A panel never spells a series name: `series(metrics.ENGINE_PROBES, fleet=FLEET)` reads the name, type and
labels off the metric object, so renaming a metric renames every query of it, and a label the metric does
not have, or a series its type does not expose (a counter's bare name, a gauge's `_bucket`), fails when the
dashboards are generated.
"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics import MetricWrapperBase

# The series each metric type exposes, by part ("" = the type's main series).
_PARTS = {
    "counter": {"": "_total"},
    "gauge": {"": ""},
    "histogram": {"bucket": "_bucket", "sum": "_sum", "count": "_count"},
}

RATE_INTERVAL = "$__rate_interval"


class Re(str):
    """A regex matcher's value (`label=~"value"`); a plain str matches exactly."""


FLEET = Re("$fleet")
RUN = Re("$run")


def series(metric: MetricWrapperBase, part: str = "", **matchers: str) -> str:
    """`name{label="v", other=~"re"}` of one series of `metric`, matchers in the order given."""
    kind = getattr(metric, "_type", "")
    parts = _PARTS.get(kind)
    if parts is None or part not in parts:
        raise ValueError(f"{metric._name} ({kind}) has no series part {part!r}; it has {sorted(parts or ())}")
    name = metric._name + parts[part]
    unknown = set(matchers) - set(metric._labelnames)
    if unknown:
        raise ValueError(f"{name} has no label {', '.join(sorted(unknown))} (it has {', '.join(metric._labelnames)})")
    if not matchers:
        return name
    body = ", ".join(f'{label}{"=~" if isinstance(value, Re) else "="}"{value}"' for label, value in matchers.items())
    return f"{name}{{{body}}}"


def by(op: str, labels: Iterable[str], inner: str) -> str:
    """`op by (labels) (inner)`."""
    return f"{op} by ({', '.join(labels)}) ({inner})"


def rate(selector: str, window: str = RATE_INTERVAL) -> str:
    return f"rate({selector}[{window}])"


def increase(selector: str, window: str = RATE_INTERVAL) -> str:
    return f"increase({selector}[{window}])"


def quantile(q: float, metric: MetricWrapperBase, labels: Iterable[str], window: str = "30m",
             **matchers: str) -> str:
    """`histogram_quantile(q, sum by (labels, le) (rate(metric_bucket{...}[window])))`."""
    bucket = series(metric, "bucket", **matchers)
    return f"histogram_quantile({q}, {by('sum', [*labels, 'le'], rate(bucket, window))})"
