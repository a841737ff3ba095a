"""Dashboards and alert rules against the real tools: promtool, a real Prometheus scraping a real rlfleet
metrics endpoint (fed by the real health monitor, rollout client and 503 watchdog, all pointed at an
engine address where nothing listens), and helm rendering the chart."""
from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client import REGISTRY

from helpers.prometheus import LocalPrometheus
from rlfleet.crds.specs import HealthSpec, WatchdogSpec
from rlfleet.observability import monitoring
from rlfleet.orchestrator.fleet.monitor import HealthMonitor, ProbeTarget
from rlfleet.orchestrator.guards.watchdog import RolloutEnginesUnavailable, WatchdogTask
from rlfleet.orchestrator.rollout.client import RetryPolicy, RolloutClient, generate_all
from rlfleet.orchestrator.run.metrics_server import MetricsServer
from rlfleet.sglang.engine import EngineClient
from rlfleet.util.binaries import tool_path
from rlfleet.util.ports import allocate_endpoint, free_port

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlfleet"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
ALERTS = CHART / "alerts" / "rlfleet-alerts.yaml"
ALERT_TESTS = REPO / "tests" / "alerts" / "rlfleet-alerts.test.yaml"
HTTP = aiohttp.ClientTimeout(total=10)


def run_tool(*argv: str | Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout_s, check=False)


# --- promtool -----------------------------------------------------------------------------------------

def test_promtool_checks_the_alert_rules():
    result = run_tool(tool_path("promtool"), "check", "rules", ALERTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(monitoring.rules(ALERTS))} rules found" in result.stdout


def test_alerts_fire_and_resolve_on_synthetic_series():
    result = run_tool(tool_path("promtool"), "test", "rules", ALERT_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_engine_state_panel_shows_each_slots_current_state(tmp_path):
    """The state-timeline panel folds the one-hot state gauge into one value per slot; its value mappings
    must name the state the slot is in. Checked by promtool on synthetic series, minute by minute."""
    board = json.loads((CHART / "dashboards" / "rlfleet-fleet.json").read_text())
    panel = next(p for p in board["panels"] if p.get("title") == "Engine state per slot")
    names = {int(code): m["text"] for mapping in panel["fieldConfig"]["defaults"]["mappings"]
             for code, m in mapping["options"].items()}
    timeline = ["starting", "alive", "dead", "starting", "alive", "failed"]  # slot 0, one state a minute
    states = ["starting", "alive", "dead", "failed", "stopped"]
    series = [{"series": f'rlfleet_engine_state{{fleet="f", slot="0", state="{state}"}}',
               "values": " ".join("1" if now == state else "0" for now in timeline)} for state in states]
    series.append({"series": 'rlfleet_engine_state{fleet="other", slot="0", state="alive"}', "values": "1x5"})
    expr = monitoring.grafana_to_promql(panel["targets"][0]["expr"], variables={"fleet": "f"})
    code = {name: code for code, name in names.items()}
    cases = [{"expr": expr, "eval_time": f"{minute}m",
              "exp_samples": [{"labels": '{fleet="f", slot="0"}', "value": code[state]}]}
             for minute, state in enumerate(timeline)]
    test_file = tmp_path / "state-panel.test.yaml"
    test_file.write_text(yaml.safe_dump({"evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "promql_expr_test": cases}]}))
    assert set(names.values()) == set(states)
    result = run_tool(tool_path("promtool"), "test", "rules", test_file)
    assert result.returncode == 0, result.stdout + result.stderr


# --- a real Prometheus scraping a real metrics endpoint -------------------------------------------------

def values(result: list[dict], label: str) -> dict[str, float]:
    return {series["metric"].get(label, ""): float(series["value"][1]) for series in result}


def exported(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_prometheus_scrapes_real_rlfleet_metrics_and_the_dashboards_and_alerts_evaluate(tmp_path):
    fleet = "it-monitoring"
    host, _ = allocate_endpoint()
    engine_url = f"http://{host}:{free_port(host)}"  # an engine address where nothing listens
    server = MetricsServer(host, 0)
    await server.start()
    prometheus = LocalPrometheus(tmp_path, f"{host}:{server.port}", [ALERTS])
    async with aiohttp.ClientSession() as session:
        engine = EngineClient(session, engine_url)
        # The 503 watchdog (more than 2 failed requests in 2 s is a strike, 3 strikes in a row trip it) fed by
        # the real rollout client. Created before the first scrape, so its counters are scraped at 0 first.
        watchdog = WatchdogTask(WatchdogSpec(window_seconds=2, check_interval_seconds=1, limit=2, checks=3),
                                recover=_nothing_to_recreate, can_serve=lambda: _serves(engine),
                                engine_logs=dict, fleet=fleet)
        client = RolloutClient(engine_url, session, fleet=fleet, on_failure=watchdog.record_failure,
                               policy=RetryPolicy(max_attempts=3, backoff_base_s=0.05, backoff_max_s=0.2,
                                                  deadline_s=10))
        marked_dead: list[str] = []

        async def on_dead(target: ProbeTarget, reason: str) -> None:
            marked_dead.append(reason)

        monitor = HealthMonitor(HealthSpec(interval_seconds=0.5, timeout_seconds=2, failure_threshold=2),
                                targets=lambda: [ProbeTarget(0, 1, engine_url)], on_dead=on_dead, fleet=fleet,
                                probe=lambda target: EngineClient(session, target.url).health_generate(2))
        try:
            await prometheus.start(session)
            up = await prometheus.wait_for(session, 'up{job="rlfleet"} == 1', bool)
            assert up, "prometheus never scraped the rlfleet metrics endpoint"

            await monitor.start()
            watching = asyncio.create_task(watchdog.run())
            try:
                while not watching.done():  # requests fail (connection refused) until the watchdog trips
                    await generate_all(client, {f"s{i}": {"text": "hi"} for i in range(8)}, concurrency=8)
                    await asyncio.sleep(0.05)
                with pytest.raises(RolloutEnginesUnavailable):
                    await watching
            finally:
                watching.cancel()
                await monitor.stop()
            assert len(marked_dead) == 1 and "connection refused" in marked_dead[0]  # dead at once, reported once

            # Prometheus holds what the process exports (once the last values are scraped).
            failed = exported("rlfleet_rollout_requests_total", fleet=fleet, outcome="failed")
            assert failed >= 8
            result = await prometheus.wait_for(
                session, f'rlfleet_rollout_requests_total{{fleet="{fleet}", outcome="failed"}}',
                lambda r: r and float(r[0]["value"][1]) == failed)
            assert values(result, "outcome") == {"failed": failed}
            names = {s["__name__"] for s in await _series(session, prometheus,
                                                          f'{{__name__=~"rlfleet_.+", fleet="{fleet}"}}')}
            assert {"rlfleet_rollout_requests_total", "rlfleet_rollout_attempts_total",
                    "rlfleet_rollout_request_duration_seconds_bucket", "rlfleet_engine_probes_total",
                    "rlfleet_engine_probe_failures_total", "rlfleet_watchdog_strikes_total",
                    "rlfleet_watchdog_trips_total", "rlfleet_watchdog_strikes_in_a_row",
                    "rlfleet_watchdog_strikes_to_trip", "rlfleet_watchdog_window_failures"} <= names

            # Dashboard panels, as Grafana sends them with $fleet set to this fleet.
            variables = {"fleet": fleet}
            strikes = await _panel(session, prometheus, "rlfleet-fleet.json", "Watchdog strikes in a row vs checks",
                                   variables)
            assert strikes == [{"fleet": fleet, "value": 3.0}, {"fleet": fleet, "value": 3.0}], \
                "strikes in a row should have reached `checks` (3)"
            attempts = await _panel(session, prometheus, "rlfleet-fleet.json", "Rollout attempts by result", variables)
            # Refused connections until the client's circuit opened (a handful, maybe all before the first
            # scrape), then attempts that fail without being sent: the panel shows them going on.
            assert {a["result"] for a in attempts} <= {"connection_refused", "circuit_open"}, attempts
            assert any(a["result"] == "circuit_open" and a["value"] > 0 for a in attempts), attempts
            assert exported("rlfleet_rollout_attempts_total", fleet=fleet, result="connection_refused") >= 1
            probe_failures = await _panel(session, prometheus, "rlfleet-fleet.json", "Probe failures by kind",
                                          variables)
            assert [p["kind"] for p in probe_failures] == ["connection_refused"]

            # The alert rules run in this Prometheus: the trip fires RlfleetWatchdogTripped.
            alerts = await prometheus.wait_for(
                session, f'ALERTS{{alertname="RlfleetWatchdogTripped", fleet="{fleet}", alertstate="firing"}}', bool)
            assert alerts and alerts[0]["metric"]["severity"] == "critical"

            # Every dashboard and alert query is valid PromQL to this Prometheus.
            queries = [q for path in DASHBOARDS for q in monitoring.dashboard_queries(path)]
            queries += list(monitoring.rule_queries(ALERTS))
            for where, expr in queries:
                try:
                    await prometheus.query(session, monitoring.grafana_to_promql(expr, variables=variables))
                except AssertionError as exc:
                    raise AssertionError(f"{where}: {exc}") from None
        finally:
            await prometheus.stop()
            await server.stop()


async def _nothing_to_recreate() -> None:
    """This fleet has no engines to recreate: the recovery the watchdog tries finds nothing to do."""


async def _serves(engine: EngineClient) -> bool:
    try:
        await engine.health_generate(2)
    except Exception:
        return False
    return True


async def _series(session: aiohttp.ClientSession, prometheus: LocalPrometheus, match: str) -> list[dict]:
    async with session.get(prometheus.url + "/api/v1/series", params={"match[]": match}, timeout=HTTP) as resp:
        body = await resp.json()
    assert body["status"] == "success", body
    return body["data"]


async def _panel(session: aiohttp.ClientSession, prometheus: LocalPrometheus, dashboard: str, title: str,
                 variables: dict[str, str], rate_interval: str = "1m") -> list[dict]:
    """Every target of the panel, evaluated now: one {label: value, ..., "value": float} per series."""
    board = json.loads((CHART / "dashboards" / dashboard).read_text())
    panel = next(p for p in board["panels"] if p.get("title") == title)
    out = []
    for target in panel["targets"]:
        expr = monitoring.grafana_to_promql(target["expr"], rate_interval=rate_interval, variables=variables)
        for series in await prometheus.query(session, expr):
            out.append({**series["metric"], "value": float(series["value"][1])})
    return sorted(out, key=lambda s: sorted(s.items()))


# --- helm ---------------------------------------------------------------------------------------------

MONITORING_ON = ["--set", "monitoring.prometheusRule.enabled=true",
                 "--set", "monitoring.trainerPodMonitor.enabled=true",
                 "--set", "monitoring.prometheusRule.ruleLabels.team=ml-infra"]


def test_helm_lint_passes_with_dashboards_and_rules_enabled():
    result = run_tool(tool_path("helm"), "lint", "--strict", CHART, *MONITORING_ON)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_helm_renders_the_dashboards_and_alert_rules_from_their_source_files(tmp_path):
    result = run_tool(tool_path("helm"), "template", "demo", CHART, "--namespace", "ml", *MONITORING_ON)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]

    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"
                  and d["metadata"]["labels"].get("grafana_dashboard") == "1"}
    assert set(configmaps) == {"demo-fleet-dashboard", "demo-training-dashboard"}
    shipped = {name: json.loads(text) for cm in configmaps.values() for name, text in cm["data"].items()}
    assert shipped == {p.name: json.loads(p.read_text()) for p in DASHBOARDS}

    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["metadata"]["namespace"] == "ml"
    source = yaml.safe_load(ALERTS.read_text())
    for group in source["groups"]:
        for r in group["rules"]:
            r["labels"] = {"team": "ml-infra", **r["labels"]}
    assert rule["spec"] == source
    # What the chart renders is a rules file promtool accepts.
    rendered = tmp_path / "rendered-rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    check = run_tool(tool_path("promtool"), "check", "rules", rendered)
    assert check.returncode == 0, check.stdout + check.stderr

    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "trainer"
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_helm_renders_no_monitoring_objects_when_turned_off():
    result = run_tool(tool_path("helm"), "template", "demo", CHART, "--set", "monitoring.dashboards.enabled=false")
    assert result.returncode == 0, result.stderr
    kinds = [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(result.stdout) if d]
    assert not [k for k in kinds if k[0] in ("PrometheusRule", "PodMonitor") or k[1].endswith("-dashboard")]
