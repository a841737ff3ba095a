"""rlfleet / Fleet: rollout and eval fleets (engines, weight sync, router, requests, watchdog, heat guard, operator)."""
from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from rlfleet.observability import metrics as m
from rlfleet.observability.dashboards.panels import (
    DASHED,
    Cell,
    dashboard,
    fixed_color,
    layout,
    stat_value,
    state_timeline,
    time_series,
)
from rlfleet.observability.dashboards.query import FLEET, Re, by, increase, quantile, rate, series

ENGINE_STATES = (("alive", "green"), ("starting", "blue"), ("dead", "red"), ("failed", "dark-red"),
                 ("stopped", "text"))


def _per_interval(op_labels: tuple[str, ...], metric, **matchers: str) -> str:
    return by("sum", op_labels, increase(series(metric, fleet=FLEET, **matchers)))


def _per_second(op_labels: tuple[str, ...], metric) -> str:
    return by("sum", op_labels, rate(series(metric, fleet=FLEET)))


def engines() -> list[Cell]:
    state = " or ".join(f"({series(m.ENGINE_STATE, fleet=FLEET, state=name)} * {i + 1})"
                        for i, (name, _) in enumerate(ENGINE_STATES))
    budget_line = {"custom.lineStyle": DASHED, "color": fixed_color("red")}
    return [
        Cell(stat_value("Alive engines", "Engine slots whose engine answers health probes, per fleet.",
                        (by("sum", ["fleet"], series(m.ENGINE_STATE, fleet=FLEET, state="alive")), "{{fleet}}"),
                        thresholds=[(None, "red"), (1, "green")]), 4),
        Cell(stat_value("Dead or failed engines",
                        "Slots marked dead (waiting for recreation) or given up (restart budget spent).",
                        (by("sum", ["fleet", "state"], series(m.ENGINE_STATE, fleet=FLEET, state=Re("dead|failed"))),
                         "{{fleet}} {{state}}"),
                        thresholds=[(None, "green"), (1, "red")]), 4),
        Cell(state_timeline("Engine state per slot", "Each slot's state over time: alive, starting, dead (marked "
                            "dead, to be recreated), failed (given up), stopped.",
                            (by("max", ["fleet", "slot"], state), "{{fleet}} / slot {{slot}}"), ENGINE_STATES), 16),
        Cell(time_series("Health probes", "GET /health_generate probes per second by result.",
                         (_per_second(("fleet", "result"), m.ENGINE_PROBES), "{{fleet}} {{result}}"), unit="reqps"), 8),
        Cell(time_series("Probe failures by kind",
                         "Failed health probes per second: refused, timeout, closed, 503, 4xx/5xx.",
                         (_per_second(("fleet", "kind"), m.ENGINE_PROBE_FAILURES), "{{fleet}} {{kind}}"),
                         unit="reqps"), 8),
        Cell(time_series("Engines marked dead by reason", "Engines marked dead in each interval: exited, "
                         "probe_failed, startup_failed, startup_timeout, load_failed, unreachable, requested.",
                         (_per_interval(("fleet", "reason"), m.ENGINES_MARKED_DEAD), "{{fleet}} {{reason}}"),
                         bars=True, decimals=0), 8),
        Cell(time_series("Recreations", "Engine slots recreated after a death, per interval.",
                         (_per_interval(("fleet",), m.ENGINE_RECREATIONS), "{{fleet}}"), bars=True, decimals=0), 8),
        Cell(time_series("Restarts per slot vs budget", "Recreations of each slot so far against "
                         "maxRestartsPerEngine; the run-wide sum against maxRestartsPerRun.",
                         (by("max", ["fleet", "slot"], series(m.ENGINE_RESTARTS, fleet=FLEET)),
                          "{{fleet}} slot {{slot}}"),
                         (by("max", ["fleet"], series(m.ENGINE_RESTART_BUDGET, fleet=FLEET, scope="engine")),
                          "{{fleet}} per-engine budget"),
                         (by("sum", ["fleet"], series(m.ENGINE_RESTARTS, fleet=FLEET)), "{{fleet}} all slots"),
                         (by("max", ["fleet"], series(m.ENGINE_RESTART_BUDGET, fleet=FLEET, scope="run")),
                          "{{fleet}} run budget"),
                         decimals=0, min_val=0, overrides=[(".*budget", budget_line)]), 8),
        Cell(time_series("Recovery duration p50 / p95", "Time from recreating dead slots until every slot is alive "
                         "again (30 min window: recoveries are rare).",
                         (quantile(0.5, m.RECOVERY_DURATION, ["fleet"], fleet=FLEET), "{{fleet}} p50"),
                         (quantile(0.95, m.RECOVERY_DURATION, ["fleet"], fleet=FLEET), "{{fleet}} p95"), unit="s"), 8),
        Cell(time_series("Probe timeouts voided", "Timed-out probes not counted toward failureThreshold because "
                         "the prober's own event loop stalled (loop_lag, mass_timeout), per interval.",
                         (_per_interval(("fleet", "reason"), m.ENGINE_PROBE_TIMEOUTS_VOIDED, ), "{{fleet}} {{reason}}"),
                         bars=True, decimals=0), 24),
    ]



def weight_sync() -> list[Cell]:
    outcome_colours = [(".* ok", {"color": fixed_color("green")}),
                       (".* (failed|invalid_snapshot)", {"color": fixed_color("red")}),
                       (".* degraded", {"color": fixed_color("orange")})]
    lag = (f"max without (run) ({series(m.RUN_STEP)}) - ignoring (fleet, slot) group_right () "
           f"({series(m.ENGINE_WEIGHT_VERSION, fleet=FLEET)} >= 0)")
    return [
        Cell(time_series("Weight sync duration p50 / p95",
                         "Whole weight syncs (validate, recover, load, read back) by outcome.",
                         (quantile(0.5, m.WEIGHT_SYNC_DURATION, ["fleet", "outcome"], fleet=FLEET),
                          "{{fleet}} {{outcome}} p50"),
                         (quantile(0.95, m.WEIGHT_SYNC_DURATION, ["fleet", "outcome"], fleet=FLEET),
                          "{{fleet}} {{outcome}} p95"), unit="s"), 8),
        Cell(time_series("Weight syncs by outcome", "ok, degraded (some engines left out), invalid_snapshot, failed.",
                         (_per_interval(("fleet", "outcome"), m.WEIGHT_SYNCS), "{{fleet}} {{outcome}}"),
                         bars=True, decimals=0, overrides=outcome_colours), 8),
        Cell(time_series("Engine weight load p95", "One engine's update_weights_from_disk call, 95th percentile.",
                         (quantile(0.95, m.ENGINE_WEIGHT_LOAD_DURATION, ["fleet"], fleet=FLEET), "{{fleet}}"),
                         unit="s"), 8),
        Cell(time_series("Weight version per engine vs run step", "The version each engine reported after its "
                         "last load (read back from /model_info), and the trainer's step.",
                         (by("max", ["fleet", "slot"], series(m.ENGINE_WEIGHT_VERSION, fleet=FLEET)),
                          "{{fleet}} slot {{slot}}"),
                         (by("max", ["run"], series(m.RUN_STEP)), "run {{run}} step"),
                         decimals=0, overrides=[("run .*", {"custom.lineStyle": DASHED, "custom.lineWidth": 2})]), 12),
        Cell(time_series("Weight version lag per engine", "Steps the engine's weights are behind the run (run step "
                         "minus engine version, same trainer process). Eval fleets are pinned to snapshots and lag "
                         "on purpose.", (lag, "{{fleet}} slot {{slot}}"), decimals=0, min_val=0,
                         thresholds=[(None, "green"), (2, "orange"), (3, "red")], threshold_style="line"), 12),
        Cell(time_series("Weight sync phases p95", "One phase of a weight sync by mode (disk, broadcast, "
                         "broadcast_fallback) and phase (validate, recover, group, fill, begin, broadcast, end, load, "
                         "read_back, verify), 95th percentile.",
                         (quantile(0.95, m.WEIGHT_SYNC_PHASE_DURATION, ["fleet", "mode", "phase"], fleet=FLEET),
                          "{{fleet}} {{mode}} {{phase}}"), unit="s"), 12),
        Cell(time_series("Checksums, fallbacks and update groups", "Served-weight checksum checks by result "
                         "(match, mismatch, unverifiable), broadcast syncs finished from disk by reason, and update "
                         "groups built, per interval.",
                         (_per_interval(("fleet", "result"), m.WEIGHT_CHECKSUMS), "{{fleet}} checksum {{result}}"),
                         (_per_interval(("fleet", "reason"), m.WEIGHT_SYNC_FALLBACKS), "{{fleet}} fallback {{reason}}"),
                         (_per_interval(("fleet",), m.WEIGHT_UPDATE_GROUP_BUILDS), "{{fleet}} group built"),
                         bars=True, decimals=0), 12),
    ]


def router() -> list[Cell]:
    return [
        Cell(time_series("Router membership changes",
                         "Workers added to (add) or removed from (remove) the router per interval.",
                         (_per_interval(("fleet", "change"), m.ROUTER_MEMBERSHIP_CHANGES), "{{fleet}} {{change}}"),
                         bars=True, decimals=0), 12),
        Cell(time_series("Router workers vs alive engines", "Workers the router listed at the last reconcile, and "
                         "engines alive: they differ while a replacement waits for weights.",
                         (by("max", ["fleet"], series(m.ROUTER_WORKERS, fleet=FLEET)), "{{fleet}} router workers"),
                         (by("sum", ["fleet"], series(m.ENGINE_STATE, fleet=FLEET, state="alive")),
                          "{{fleet}} alive engines"), decimals=0, min_val=0), 12),
        Cell(time_series("Router restarts vs budget", "Router restarts so far (a local router process restarted, "
                         "or the router pod replaced) and the router's maxRestarts: one exit more than the budget "
                         "fails the run.",
                         (by("max", ["fleet"], series(m.ROUTER_RESTARTS, fleet=FLEET)), "{{fleet}} restarts"),
                         (by("max", ["fleet"], series(m.ROUTER_RESTART_BUDGET, fleet=FLEET)),
                          "{{fleet}} budget (maxRestarts)"),
                         decimals=0, min_val=0), 8),
        Cell(time_series("Router up", "1 while the fleet's router runs and answers; 0 from its exit until it "
                         "serves again.", (by("min", ["fleet"], series(m.ROUTER_UP, fleet=FLEET)),
                          "{{fleet}} router up"),
                         decimals=0, min_val=0), 8),
        Cell(time_series("Rollout circuit open and probes", "1 while the rollout client's circuit to the router is "
                         "open: the router refused connections, no request is sent, one GET /health probe now and "
                         "then. Probes by result.",
                         (by("max", ["fleet"], series(m.ROLLOUT_CIRCUIT_OPEN, fleet=FLEET)), "{{fleet}} circuit open"),
                         (_per_interval(("fleet",), m.ROLLOUT_CIRCUIT_OPENS), "{{fleet}} opened"),
                         (_per_interval(("fleet", "result"), m.ROLLOUT_CIRCUIT_PROBES), "{{fleet}} probes {{result}}"),
                         decimals=0, min_val=0), 8),
    ]


def requests() -> list[Cell]:
    return [
        Cell(time_series("Rollout requests by outcome",
                         "Samples settled per second: ok, failed (retries exhausted or not retryable), deadline.",
                         (_per_second(("fleet", "outcome"), m.ROLLOUT_REQUESTS), "{{fleet}} {{outcome}}"),
                         unit="reqps"), 8),
        Cell(time_series("Rollout attempts by result", "HTTP attempts through the router per second: ok, "
                         "unavailable (503), connection_refused, connection_closed, timeout, server_error, "
                         "client_error, aborted, bad_response, duplicate_rid.",
                         (_per_second(("fleet", "result"), m.ROLLOUT_ATTEMPTS), "{{fleet}} {{result}}"),
                         unit="reqps"), 8),
        Cell(time_series("Rollout request duration p50 / p95", "From the first attempt to the final outcome of a "
                         "sample.",
                         (quantile(0.5, m.ROLLOUT_REQUEST_DURATION, ["fleet"], "$__rate_interval", fleet=FLEET),
                          "{{fleet}} p50"),
                         (quantile(0.95, m.ROLLOUT_REQUEST_DURATION, ["fleet"], "$__rate_interval", fleet=FLEET),
                          "{{fleet}} p95"), unit="s"), 8),
        Cell(time_series("Rollout continuations", "Requests continued on another engine from the tokens they had "
                         "(spec.rollout.continuation), per interval.",
                         (_per_interval(("fleet",), m.ROLLOUT_CONTINUATIONS), "{{fleet}}"), bars=True, decimals=0), 12),
        Cell(time_series("Tokens saved by continuations", "Generated tokens kept that a restart from scratch would "
                         "have generated again, per interval.",
                         (_per_interval(("fleet",), m.ROLLOUT_CONTINUATION_TOKENS_SAVED), "{{fleet}}"), bars=True,
                         decimals=0), 12),
    ]


def watchdog() -> list[Cell]:
    return [
        Cell(time_series("Watchdog strikes in a row vs checks", "Consecutive checks whose window held more failed "
                         "rollout requests than the limit; the run trips at `checks`.",
                         (by("max", ["fleet"], series(m.WATCHDOG_STRIKES_IN_A_ROW, fleet=FLEET)),
                          "{{fleet}} strikes in a row"),
                         (by("max", ["fleet"], series(m.WATCHDOG_STRIKES_TO_TRIP, fleet=FLEET)),
                          "{{fleet}} checks (trip)"),
                         decimals=0, min_val=0,
                         overrides=[(r".*\(trip\)", {"custom.lineStyle": DASHED, "color": fixed_color("red")})]), 8),
        Cell(time_series("Failed rollout requests in the window", "What the watchdog counted at its last check.",
                         (by("max", ["fleet"], series(m.WATCHDOG_WINDOW_FAILURES, fleet=FLEET)), "{{fleet}}"),
                         decimals=0, min_val=0), 8),
        Cell(time_series("Watchdog strikes, trips and recoveries", "Strikes (checks over the limit) and trips "
                         "(`checks` strikes in a row) per interval. Recoveries by verdict of the one-token probe "
                         "through the router.",
                         (_per_interval(("fleet",), m.WATCHDOG_STRIKES), "{{fleet}} strikes"),
                         (_per_interval(("fleet",), m.WATCHDOG_TRIPS), "{{fleet}} trips"),
                         (_per_interval(("fleet", "verdict"), m.WATCHDOG_RECOVERIES),
                          "{{fleet}} recoveries {{verdict}}"),
                         bars=True, decimals=0), 8),
    ]


def heat_guard() -> list[Cell]:
    return [
        Cell(time_series("Engines paused by the heat guard",
                         "Engines whose generation the heat guard holds paused (GPU too hot).",
                         (by("sum", ["fleet"], series(m.HEAT_GUARD_PAUSED, fleet=FLEET)), "{{fleet}}"),
                         decimals=0, min_val=0), 8),
        Cell(time_series("GPU temperature per engine", "Last temperature read for each engine's GPU; pause at 84 C, "
                         "resume at 74 C by default.",
                         (by("max", ["fleet", "slot"], series(m.GPU_TEMPERATURE, fleet=FLEET)),
                          "{{fleet}} slot {{slot}}"),
                         unit="celsius", thresholds=[(None, "green"), (74, "orange"), (84, "red")],
                         threshold_style="line+area"), 8),
        Cell(time_series("Heat-guard pauses and paused seconds",
                         "Pauses started, and seconds of finished pauses, per interval.",
                         (_per_interval(("fleet",), m.HEAT_GUARD_PAUSES), "{{fleet}} pauses"),
                         (by("sum", ["fleet"], increase(series(m.HEAT_GUARD_PAUSE_DURATION, "sum", fleet=FLEET))),
                          "{{fleet}} paused seconds"),
                         bars=True, overrides=[(".*seconds", {"unit": "s", "custom.axisPlacement": "right"})]), 8),
        Cell(time_series("Heat-guard errors",
                         "Temperature reads that failed (by source) and pause/continue calls that failed.",
                         (_per_interval(("fleet", "source"), m.HEAT_GUARD_READ_ERRORS), "{{fleet}} read {{source}}"),
                         (_per_interval(("fleet", "action"), m.HEAT_GUARD_ACTION_ERRORS), "{{fleet}} {{action}}"),
                         bars=True, decimals=0), 12),
        Cell(time_series("Training steps that overlapped a pause", "Steps whose timings include a heat-guard pause.",
                         (_per_interval(("fleet",), m.STEPS_OVERLAPPING_PAUSE), "{{fleet}}"), bars=True, decimals=0),
             12),
    ]


def operator() -> list[Cell]:
    return [
        Cell(time_series("Reconciles by kind and outcome",
                         "Operator reconciles of TrainingRuns, RolloutFleets and EvalFleets per second.",
                         (by("sum", ["kind", "outcome"], rate(series(m.OPERATOR_RECONCILES))), "{{kind}} {{outcome}}"),
                         unit="ops"), 8),
        Cell(time_series("Reconcile errors by reason", "Reconciles that failed (API errors, bad specs) per interval.",
                         (by("sum", ["kind", "reason"], increase(series(m.OPERATOR_RECONCILE_ERRORS))),
                          "{{kind}} {{reason}}"), bars=True, decimals=0), 8),
        Cell(time_series("Reconcile duration p95", "One reconcile, API calls included, 95th percentile by kind.",
                         (quantile(0.95, m.OPERATOR_RECONCILE_DURATION, ["kind"], "$__rate_interval"), "{{kind}}"),
                         unit="s"), 8),
        Cell(time_series("Engine pods recreated and slots given up",
                         "Engine pods the operator recreated, and slots it gave up (budget spent).",
                         (_per_interval(("namespace", "fleet"), m.OPERATOR_RECREATIONS),
                          "{{namespace}}/{{fleet}} recreated"),
                         (_per_interval(("namespace", "fleet"), m.OPERATOR_SLOTS_FAILED),
                          "{{namespace}}/{{fleet}} given up"), bars=True, decimals=0), 8),
        Cell(time_series("Ready engine pods", "Ready engine pods per fleet at the operator's last reconcile.",
                         (by("max", ["namespace", "fleet"], series(m.OPERATOR_READY_ENGINES, fleet=FLEET)),
                          "{{namespace}}/{{fleet}}"), decimals=0, min_val=0), 8),
        Cell(time_series("Kubernetes API requests", "Requests the operator's reconciles made, per second by verb.",
                         (by("sum", ["verb"], rate(series(m.OPERATOR_API_REQUESTS))), "{{verb}}"), unit="reqps"), 8),
    ]


def build() -> Dashboard:
    board = dashboard("rlfleet-fleet", "rlfleet / Fleet",
                      "Rollout and eval fleets: engine health, deaths and recovery, weight sync, router membership, "
                      "rollout requests, the 503 watchdog and the heat guard.",
                      "fleet", "Fleet", series(m.ENGINE_STATE))
    return layout(board, [("Engines", engines()), ("Weight sync", weight_sync()), ("Router", router()),
                          ("Rollout requests", requests()), ("503 watchdog", watchdog()),
                          ("Heat guard", heat_guard()), ("Operator", operator())])
