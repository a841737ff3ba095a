"""The queries of Grafana dashboards and Prometheus rule files, and their check against what rlfleet exports.

A dashboard panel or alert that queries a name no code exports is silently empty. `problems(expr)` says
what is wrong with one query: a series rlfleet does not export, a label the metric does not have, a
rate() over something that is not a counter. `dashboard_queries` and `rule_queries` list the queries of
the files, each with where it is, so a check can name the panel or alert.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import yaml

from rlfleet.observability import metrics, promql

# Labels a scrape adds to every series (Prometheus itself, or the Prometheus operator's relabelling).
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "service", "endpoint"})

_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<expr>.+),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*$", re.S)
_QUERY_RESULT = re.compile(r"^\s*query_result\((?P<expr>.+)\)\s*$", re.S)
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def dashboard_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable of a Grafana dashboard JSON file."""
    board = json.loads(Path(path).read_text())
    for panel in _panels(board.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield f"{Path(path).name}: {panel.get('title')} [{target.get('refId')}]", target["expr"]
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        match = _LABEL_VALUES.match(query) or _QUERY_RESULT.match(query)
        if match:  # label_values(label) alone reads no series
            yield f"{Path(path).name}: variable ${var['name']}", match.group("expr")


def rules(path: Path) -> list[dict]:
    """Every rule (alerting and recording) of a Prometheus rules file."""
    return [rule for group in yaml.safe_load(Path(path).read_text())["groups"] for rule in group["rules"]]


def rule_queries(path: Path) -> Iterator[tuple[str, str]]:
    for rule in rules(path):
        yield f"{Path(path).name}: {rule.get('alert') or rule.get('record')}", rule["expr"]


def grafana_to_promql(expr: str, *, rate_interval: str = "1m", variables: Mapping[str, str] | None = None) -> str:
    """A dashboard query as Prometheus itself takes it: Grafana's variables replaced.

    `$__rate_interval`, `$__interval` and `$__range` become `rate_interval`; a template variable becomes
    its value from `variables`, or `.*` (what "All" sends to a regex matcher).
    """
    variables = variables or {}

    def value(match: re.Match) -> str:
        name = next(group for group in match.groups() if group)
        if name.startswith("__"):
            return rate_interval
        return variables.get(name, ".*")

    return _VARIABLE.sub(value, expr)


def problems(expr: str, exported: Mapping[str, frozenset[str]] | None = None) -> list[str]:
    """What is wrong with the series `expr` reads, against what rlfleet exports; [] when nothing is."""
    exported = promql.exported_series(metrics.REGISTRY) if exported is None else exported
    found = promql.selectors(expr)
    if not found:
        return ["reads no series"]
    out = []
    for sel in found:
        if sel.metric not in exported:
            out.append(f"{sel.metric} is not exported by rlfleet.observability.metrics")
            continue
        unknown = set(sel.labels) - exported[sel.metric] - TARGET_LABELS
        if unknown:
            out.append(f"{sel.metric} has no label {', '.join(sorted(unknown))} "
                       f"(it has {', '.join(sorted(exported[sel.metric])) or 'none'})")
        if sel.function in promql.COUNTER_FUNCTIONS and not sel.metric.endswith(promql.COUNTER_SUFFIXES):
            out.append(f"{sel.function}() of {sel.metric}, which is not a counter")
    return out
