"""Every dashboard panel and alert rule queries series that rlfleet.observability.metrics really exports.

The names come from the registry's collectors as prometheus_client exposes them (a Counter `x_total`,
a Histogram's `x_bucket`/`x_sum`/`x_count`), so renaming a metric or a label in rlfleet/observability/metrics.py
without updating the dashboards and alerts fails here, naming the panel or alert.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlfleet.observability import metrics, monitoring, promql
from rlfleet.util.generated import stale_files

CHART = Path(__file__).resolve().parents[2] / "charts" / "rlfleet"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
ALERTS = CHART / "alerts" / "rlfleet-alerts.yaml"
ALERT_TESTS = CHART.parents[1] / "tests" / "alerts" / "rlfleet-alerts.test.yaml"
QUERIES = [q for path in DASHBOARDS for q in monitoring.dashboard_queries(path)] + list(monitoring.rule_queries(ALERTS))
EXPORTED = promql.exported_series(metrics.REGISTRY)


def test_the_chart_ships_the_fleet_and_training_dashboards_and_the_alert_rules():
    assert {p.name for p in DASHBOARDS} >= {"rlfleet-fleet.json", "rlfleet-training.json"}
    assert len(monitoring.rules(ALERTS)) >= 10
    assert len(QUERIES) >= 50


@pytest.mark.parametrize(("where", "expr"), QUERIES, ids=[where for where, _ in QUERIES])
def test_query_reads_only_series_rlfleet_exports(where, expr):
    assert monitoring.problems(monitoring.grafana_to_promql(expr), EXPORTED) == [], f"{where}: {expr}"


def test_a_renamed_metric_or_label_is_caught():
    panel = "sum by (fleet, result) (rate(rlfleet_engine_probes_total{fleet=~\"$fleet\"}[$__rate_interval]))"
    assert monitoring.problems(monitoring.grafana_to_promql(panel), EXPORTED) == []
    renamed = panel.replace("rlfleet_engine_probes_total", "rlfleet_engine_probe_total")
    assert monitoring.problems(monitoring.grafana_to_promql(renamed), EXPORTED) == [
        "rlfleet_engine_probe_total is not exported by rlfleet.observability.metrics"]
    relabelled = panel.replace("{fleet=", "{pool=")
    assert monitoring.problems(monitoring.grafana_to_promql(relabelled), EXPORTED) == [
        "rlfleet_engine_probes_total has no label pool (it has fleet, result)"]


def test_histogram_and_counter_series_are_named_as_prometheus_client_exposes_them():
    assert {"rlfleet_recovery_duration_seconds_bucket", "rlfleet_recovery_duration_seconds_sum",
            "rlfleet_recovery_duration_seconds_count"} <= EXPORTED.keys()
    assert "le" in EXPORTED["rlfleet_recovery_duration_seconds_bucket"]
    assert "rlfleet_recovery_duration_seconds" not in EXPORTED  # a histogram has no bare series
    assert "rlfleet_engine_recreations_total" in EXPORTED
    assert "rlfleet_engine_recreations" not in EXPORTED  # a counter's series ends in _total
    assert monitoring.problems("rate(rlfleet_router_workers[5m])", EXPORTED) == [
        "rate() of rlfleet_router_workers, which is not a counter"]


def test_every_exported_rlfleet_name_follows_the_naming_rules():
    for name in EXPORTED:
        if not name.startswith("rlfleet_") or name.endswith("_created"):
            continue
        assert "_seconds_" not in name or name.endswith(("_bucket", "_sum", "_count", "_seconds_total")), name


@pytest.mark.parametrize("rule", monitoring.rules(ALERTS), ids=lambda r: r.get("alert") or r.get("record"))
def test_alert_rule_has_for_severity_summary_and_description(rule):
    assert rule["alert"].startswith("Rlfleet")
    assert "for" in rule, "an alert without `for:` fires on a single bad scrape"
    assert rule["labels"]["severity"] in ("critical", "warning", "info")
    assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip()


def _alert_cases() -> list[dict]:
    return yaml.safe_load(ALERT_TESTS.read_text())["tests"]


def test_the_alert_tests_load_the_charts_rules_file():
    rule_files = yaml.safe_load(ALERT_TESTS.read_text())["rule_files"]
    assert [(ALERT_TESTS.parent / f).resolve() for f in rule_files] == [ALERTS.resolve()]


@pytest.mark.parametrize("alert", [r["alert"] for r in monitoring.rules(ALERTS) if "alert" in r])
def test_every_alert_rule_has_a_promtool_case_in_which_it_fires(alert):
    """An alert only checked with `exp_alerts: []` passes even when its expression can never match (a join
    that matches no series, a wrong label or metric name): each one must also be seen firing."""
    firing = [case for test in _alert_cases() for case in test.get("alert_rule_test", [])
              if case["alertname"] == alert and case.get("exp_alerts")]
    assert firing, f"{ALERT_TESTS.name} has no case in which {alert} fires (non-empty exp_alerts)"


@pytest.mark.parametrize("series", sorted({s["series"] for test in _alert_cases() for s in test["input_series"]}))
def test_alert_case_series_are_what_rlfleet_exports(series):
    """The synthetic series carry the names and labels the code exports, so a case that fires proves the
    rule matches real series."""
    assert monitoring.problems(series, EXPORTED) == [], series


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_importable_by_the_grafana_sidecar(path):
    board = json.loads(path.read_text())
    assert board["uid"] == path.stem and board["title"].startswith("rlfleet / ")
    assert "id" not in board or board["id"] is None, "a fixed dashboard id clashes on import"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = list(monitoring._panels(board["panels"]))
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what the panel shows"
        assert panel["targets"] and all(t["refId"] for t in panel["targets"]), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]


# --- the lexer ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("expr", "expected"), [
    ('histogram_quantile(0.95, sum by (fleet, le) (rate(a_bucket{fleet=~".*"}[5m])))',
     [promql.Selector("a_bucket", ("fleet",), "rate")]),
    ("sum(rate(a_total[5m])) by (fleet) / ignoring (x) group_left count(b)",
     [promql.Selector("a_total", (), "rate"), promql.Selector("b", (), "count")]),
    ("max without (run) (a) - ignoring (fleet, slot) group_right () (b >= 0)",
     [promql.Selector("a", (), "max"), promql.Selector("b", (), None)]),
    ('{__name__="a_total", fleet="x"} offset 1h', [promql.Selector("a_total", ("fleet",), None)]),
    ('max_over_time(a[10m:1m]) > bool 1e3 and on (slot) b{state="dead"} # trailing comment',
     [promql.Selector("a", (), "max_over_time"), promql.Selector("b", ("state",), None)]),
    ('label_replace(a, "dst", "$1", "src", "(.*)")', [promql.Selector("a", (), "label_replace")]),
    ('a{msg="braces {in} a string"} unless b', [promql.Selector("a", ("msg",), None), promql.Selector("b", (), None)]),
])
def test_selectors(expr, expected):
    assert promql.selectors(expr) == expected


@pytest.mark.parametrize("expr", ["sum(rate(a[5m])", "a{fleet=}", "sum by (x)", "a ~ b"])
def test_unreadable_expressions_raise(expr):
    with pytest.raises(promql.PromQLSyntaxError):
        promql.selectors(expr)


def test_check_monitoring_command_names_the_panel_that_reads_a_missing_metric(tmp_path, capsys):
    from rlfleet.observability import cli as monitoring_cli

    board = json.loads((CHART / "dashboards" / "rlfleet-fleet.json").read_text())
    assert monitoring_cli.main([str(CHART / "dashboards" / "rlfleet-fleet.json")]) == 0
    panel = next(p for p in board["panels"] if p.get("title") == "Health probes")
    panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace("rlfleet_engine_probes_total",
                                                                      "rlfleet_probes_total")
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(board))
    capsys.readouterr()
    assert monitoring_cli.main([str(edited)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "edited.json: Health probes [A]: rlfleet_probes_total is not exported by rlfleet.observability.metrics"]


# --- dashboards as code -------------------------------------------------------------------------------

def test_committed_dashboards_are_what_the_code_generates():
    from rlfleet.observability import dashboards

    stale = stale_files(dashboards.generated_files())
    assert not stale, f"run `make dashboards`: {[p.name for p in stale]} differ from what the code generates"


def test_dashboards_check_mode_reports_a_hand_edited_file(tmp_path, capsys):
    from rlfleet.observability import dashboards

    assert dashboards.main(["--dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rlfleet-fleet.json", "rlfleet-training.json"]
    assert dashboards.main(["--check", "--dir", str(tmp_path)]) == 0
    (tmp_path / "rlfleet-fleet.json").write_text("{}\n")
    assert dashboards.main(["--check", "--dir", str(tmp_path)]) == 1
    assert "rlfleet-fleet.json" in capsys.readouterr().err


def test_renaming_a_metric_renames_its_panels(monkeypatch):
    from rlfleet.observability import dashboards
    from rlfleet.observability.dashboards import query

    monkeypatch.setattr(metrics.ENGINE_PROBES, "_name", "rlfleet_engine_health_checks")
    board = json.loads(dashboards.generated_files()[dashboards.DASHBOARD_DIR / "rlfleet-fleet.json"])
    panel = next(p for p in board["panels"] if p["title"] == "Health probes")
    assert panel["targets"][0]["expr"] == ('sum by (fleet, result) (rate(rlfleet_engine_health_checks_total'
                                           '{fleet=~"$fleet"}[$__rate_interval]))')
    with pytest.raises(ValueError, match="has no label pool"):
        query.series(metrics.ENGINE_PROBES, pool="x")
    with pytest.raises(ValueError, match="no series part 'bucket'"):
        query.series(metrics.ENGINE_RECREATIONS, "bucket")
