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
# Timed-out probes that did not count toward failureThreshold because the prober's own event loop
# stalled (orchestrator/fleet/health.py). reason: loop_lag (the loop lagged beyond max(1 s, timeout) while
# the probe waited), mass_timeout (most of the fleet timed out at once while the loop lagged).
ENGINE_PROBE_TIMEOUTS_VOIDED = Counter(
    "rlfleet_engine_probe_timeouts_voided", "Probe timeouts not counted because the prober's event loop stalled.",
    ["fleet", "reason"], registry=REGISTRY,
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
# The restart budgets of RecoverySpec, so dashboards and alerts can compare restarts with them.
# scope: engine (maxRestartsPerEngine, per slot), run (maxRestartsPerRun, all slots of the fleet).
ENGINE_RESTART_BUDGET = Gauge(
    "rlfleet_engine_restart_budget", "Recreations allowed by the recovery spec.", ["fleet", "scope"],
    registry=REGISTRY,
)
RECOVERY_DURATION = Histogram(
    "rlfleet_recovery_duration_seconds", "Time from recreating dead slots to all slots alive.", ["fleet"],
    buckets=DURATION_BUCKETS, registry=REGISTRY,
)



def set_engine_state(fleet: str, slot: int, state: str, states: tuple[str, ...]) -> None:
    """`rlfleet_engine_state` of one slot: 1 for `state`, 0 for the other `states`."""
    for candidate in states:
        ENGINE_STATE.labels(fleet=fleet, slot=str(slot), state=candidate).set(1 if candidate == state else 0)


def forget_engine_slot(fleet: str, slot: int, states: tuple[str, ...]) -> None:
    """Drop a slot's per-engine series (it was scaled away): no stale state or weight version stays behind
    for dashboards and alerts."""
    for candidate in states:
        _remove(ENGINE_STATE, fleet, str(slot), candidate)
    _remove(ENGINE_RESTARTS, fleet, str(slot))
    _remove(ENGINE_WEIGHT_VERSION, fleet, str(slot))


def _remove(metric: Gauge, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never set
        pass


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
# Per sync, by the mode that delivered the weights (disk, broadcast; broadcast_fallback: disk after a failed
# broadcast) and phase (validate, recover, group, fill, begin, broadcast, end, load, read_back, verify, snapshot_wait).
WEIGHT_SYNC_PHASE_DURATION = Histogram(
    "rlfleet_weight_sync_phase_duration_seconds", "One phase of a weight sync.", ["fleet", "mode", "phase"],
    buckets=DURATION_BUCKETS, registry=REGISTRY,
)
WEIGHT_SYNC_BYTES = Counter(
    "rlfleet_weight_sync_bytes", "Weight bytes broadcast into the update group (sent once per sync).",
    ["fleet"], registry=REGISTRY,
)
WEIGHT_SYNC_FALLBACKS = Counter(
    "rlfleet_weight_sync_fallbacks", "Broadcast syncs finished from disk, by reason (start, transfer).",
    ["fleet", "reason"], registry=REGISTRY,
)
WEIGHT_UPDATE_GROUP_BUILDS = Counter(
    "rlfleet_weight_update_group_builds", "Update groups built (first, and after a membership change).",
    ["fleet"], registry=REGISTRY,
)
# result: match, mismatch, unverifiable (no tensor name in common, or the call failed).
WEIGHT_CHECKSUMS = Counter(
    "rlfleet_weight_checksums", "Served-weight checksum checks per engine, by result.", ["fleet", "result"],
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
# A fleet's router process exited (local runs) or its pod was replaced (Kubernetes) and was brought back.
ROUTER_RESTARTS = Counter(
    "rlfleet_router_restarts_total", "Router restarts (local process restarted, or router pod replaced).",
    ["fleet"], registry=REGISTRY,
)
# The router spec's maxRestarts, so dashboards and alerts can compare restarts with it.
ROUTER_RESTART_BUDGET = Gauge(
    "rlfleet_router_restart_budget", "Router restarts allowed per run (router maxRestarts).", ["fleet"],
    registry=REGISTRY,
)
# 1 while the fleet's router answers, 0 from its exit until it serves again.
ROUTER_UP = Gauge(
    "rlfleet_router_up", "1 while the fleet's router process runs and answers.", ["fleet"], registry=REGISTRY
)


# --- Rollout request path -------------------------------------------------------------------------
# One per request (sample) when it settles: ok, failed (retries exhausted or not retryable), deadline.
ROLLOUT_REQUESTS = Counter(
    "rlfleet_rollout_requests_total", "Rollout requests (samples) by final outcome.", ["fleet", "outcome"],
    registry=REGISTRY,
)
# One per HTTP attempt: ok, or the failure kind (connection_refused, connection_closed, timeout,
# unavailable, server_error, client_error, aborted = HTTP 200 with finish_reason abort, bad_response),
# or duplicate_rid.
ROLLOUT_ATTEMPTS = Counter(
    "rlfleet_rollout_attempts_total", "Rollout HTTP attempts through the router by result.", ["fleet", "result"],
    registry=REGISTRY,
)
ROLLOUT_REQUEST_DURATION = Histogram(
    "rlfleet_rollout_request_duration_seconds", "Time from first attempt to final outcome of a rollout request.",
    ["fleet"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800), registry=REGISTRY,
)

# The rollout client's circuit on the router path: open while the router refuses connections (no
# request is sent then; the attempts it would have made fail fast and still count for the watchdog).
# Continuation (spec.rollout.continuation): one per resubmission of a prefix, counted when the request is delivered.
ROLLOUT_CONTINUATIONS = Counter(
    "rlfleet_rollout_continuations",
    "Rollout requests resubmitted with the tokens generated so far after their attempt broke (engine died, "
    "left the router, aborted).", ["fleet"], registry=REGISTRY,
)
ROLLOUT_CONTINUATION_TOKENS_SAVED = Counter(
    "rlfleet_rollout_continuation_tokens_saved",
    "Generated tokens kept by continuations that a restart from scratch would have generated again.", ["fleet"],
    registry=REGISTRY,
)
ROLLOUT_CIRCUIT_OPEN = Gauge(
    "rlfleet_rollout_circuit_open", "1 while the rollout circuit to the router is open (or half-open).", ["fleet"],
    registry=REGISTRY,
)
ROLLOUT_CIRCUIT_OPENS = Counter(
    "rlfleet_rollout_circuit_opens_total", "Times the rollout circuit opened on consecutive connection failures.",
    ["fleet"], registry=REGISTRY,
)
ROLLOUT_CIRCUIT_PROBES = Counter(
    "rlfleet_rollout_circuit_probes_total", "Probes of an open rollout circuit by result (ok, failed).",
    ["fleet", "result"], registry=REGISTRY,
)

# --- 503 watchdog ---------------------------------------------------------------------------------
WATCHDOG_STRIKES = Counter(
    "rlfleet_watchdog_strikes_total", "Watchdog checks whose window held more failures than the limit.", ["fleet"],
    registry=REGISTRY,
)
WATCHDOG_TRIPS = Counter(
    "rlfleet_watchdog_trips_total", "Times the watchdog saw its number of strikes in a row.", ["fleet"],
    registry=REGISTRY,
)
WATCHDOG_STRIKES_IN_A_ROW = Gauge(
    "rlfleet_watchdog_strikes_in_a_row", "Current run of consecutive watchdog strikes.", ["fleet"], registry=REGISTRY,
)
# The spec's `checks`: strikes in a row that trip the watchdog (the line strikes_in_a_row must not reach).
WATCHDOG_STRIKES_TO_TRIP = Gauge(
    "rlfleet_watchdog_strikes_to_trip", "Strikes in a row that trip the watchdog (spec checks).", ["fleet"],
    registry=REGISTRY,
)
# Recoveries after a trip by verdict: ok (the probe through the router passed), failed.
WATCHDOG_RECOVERIES = Counter(
    "rlfleet_watchdog_recoveries_total", "Watchdog recoveries by verdict of the probe through the router.",
    ["fleet", "verdict"], registry=REGISTRY,
)
WATCHDOG_WINDOW_FAILURES = Gauge(
    "rlfleet_watchdog_window_failures", "Failed rollout requests in the window at the last check.", ["fleet"],
    registry=REGISTRY,
)

# --- Heat guard -----------------------------------------------------------------------------------
HEAT_GUARD_PAUSES = Counter(
    "rlfleet_heat_guard_pauses_total", "Generation pauses by the heat guard.", ["fleet", "slot"], registry=REGISTRY,
)
# Its _sum is the paused seconds, its _count the finished pauses.
HEAT_GUARD_PAUSE_DURATION = Histogram(
    "rlfleet_heat_guard_pause_duration_seconds", "Length of finished heat-guard pauses.", ["fleet", "slot"],
    buckets=(5, 15, 30, 45, 60, 90, 120, 180, 300, 600), registry=REGISTRY,
)
HEAT_GUARD_PAUSED = Gauge(
    "rlfleet_heat_guard_paused", "1 while the heat guard holds generation paused on the engine.", ["fleet", "slot"],
    registry=REGISTRY,
)
GPU_TEMPERATURE = Gauge(
    "rlfleet_gpu_temperature_celsius", "Last GPU temperature read for the engine.", ["fleet", "slot"],
    registry=REGISTRY,
)
HEAT_GUARD_READ_ERRORS = Counter(
    "rlfleet_heat_guard_read_errors_total", "Temperature reads that failed.", ["fleet", "source"], registry=REGISTRY,
)
HEAT_GUARD_ACTION_ERRORS = Counter(
    "rlfleet_heat_guard_action_errors_total", "Pause/continue calls to an engine that failed.",
    ["fleet", "slot", "action"], registry=REGISTRY,
)
STEPS_OVERLAPPING_PAUSE = Counter(
    "rlfleet_steps_overlapping_heat_pause_total", "Training steps that overlapped a heat-guard pause.", ["fleet"],
    registry=REGISTRY,
)



def version_number(version: str | None) -> float:
    """The gauge value of a weight version label ("<step>"); -1 when it is not a number."""
    try:
        return float(version) if version is not None else -1.0
    except ValueError:
        return -1.0


# --- The run (rlfleet run / the trainer pod) ---------------------------------------------------------
RUN_STEP = Gauge("rlfleet_run_step", "Training steps completed.", ["run"], registry=REGISTRY)
RUN_REWARD_MEAN = Gauge("rlfleet_run_reward_mean", "Mean rollout reward of the last step.", ["run"], registry=REGISTRY)
# phase: rollout_wait, train, snapshot_wait, export, weight_sync, eval_held, checkpoint (the per-step record's
# phases).
RUN_STEP_PHASE_DURATION = Histogram(
    "rlfleet_run_step_phase_seconds", "Seconds each phase of a training step took.", ["run", "phase"],
    buckets=DURATION_BUCKETS, registry=REGISTRY,
)

# --- Checkpoints ------------------------------------------------------------------------------------
# Seconds the training loop waited per checkpoint (copying the trainer's state off the device), and
# seconds writing it took beside training (shard, meta, marker). outcome: written, failed.
CHECKPOINT_LOOP_HELD = Histogram(
    "rlfleet_checkpoint_loop_held_seconds", "Seconds a checkpoint held the training loop (state off the device).",
    ["run"], buckets=DURATION_BUCKETS, registry=REGISTRY,
)
CHECKPOINT_WRITE_DURATION = Histogram(
    "rlfleet_checkpoint_write_seconds", "Seconds writing a checkpoint took, beside training.", ["run"],
    buckets=DURATION_BUCKETS, registry=REGISTRY,
)
CHECKPOINTS = Counter("rlfleet_checkpoints_total", "Checkpoints by outcome.", ["run", "outcome"], registry=REGISTRY)
CHECKPOINT_STEP = Gauge("rlfleet_checkpoint_step", "Step of the newest complete checkpoint.", ["run"],
                        registry=REGISTRY)

# --- Evaluation ---------------------------------------------------------------------------------------
EVAL_IN_FLIGHT = Gauge(
    "rlfleet_eval_in_flight", "Evaluation points dispatched and not yet settled.", ["run", "posture"],
    registry=REGISTRY,
)
# outcome: evaluated, skipped
EVAL_POINTS = Counter(
    "rlfleet_eval_points_total", "Evaluation points settled, by outcome.", ["run", "posture", "outcome"],
    registry=REGISTRY,
)
# reason: busy, export_failed, ckpt_missing, unhealthy, pin_violation, crashed, cancelled, or an EvalSkip's own.
EVAL_SKIPPED = Counter(
    "rlfleet_eval_skipped_total", "Evaluation points skipped, by reason.", ["run", "reason"], registry=REGISTRY,
)
EVAL_DURATION = Histogram(
    "rlfleet_eval_duration_seconds", "One point's evaluation (pin, probe, generate, score) until it settled.",
    ["run", "posture", "outcome"], buckets=DURATION_BUCKETS, registry=REGISTRY,
)
EVAL_EXPORT_DURATION = Histogram(
    "rlfleet_eval_export_duration_seconds", "Writing one eval snapshot to the volume (beside training).", ["run"],
    buckets=DURATION_BUCKETS, registry=REGISTRY,
)
EVAL_EXPORT_BLOCKING = Histogram(
    "rlfleet_eval_export_blocking_seconds",
    "Time the training loop was held to take an eval snapshot's weights off the device.",
    ["run"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY,
)
EVAL_BACKPRESSURE_WAIT = Histogram(
    "rlfleet_eval_backpressure_wait_seconds",
    "Time the training loop waited for a pending point (overflowPolicy backpressure).",
    ["run"], buckets=DURATION_BUCKETS, registry=REGISTRY,
)
EVAL_SCORE = Gauge("rlfleet_eval_score", "Score of the last evaluated point, per dataset.", ["run", "dataset"],
                   registry=REGISTRY)
EVAL_SCORE_STEP = Gauge(
    "rlfleet_eval_score_step", "Training step of the last evaluated point (the step rlfleet_eval_score belongs to).",
    ["run"], registry=REGISTRY,
)
EVAL_RESPONSE_LENGTH = Gauge(
    "rlfleet_eval_response_length_tokens", "Mean response length of the last evaluated point, per dataset.",
    ["run", "dataset"], registry=REGISTRY,
)
EVAL_TRUNCATED_RATIO = Gauge(
    "rlfleet_eval_truncated_ratio", "Share of responses cut at maxNewTokens at the last evaluated point, per dataset.",
    ["run", "dataset"], registry=REGISTRY,
)
EVAL_MIXED_VERSION_RATIO = Gauge(
    "rlfleet_eval_mixed_version_ratio", "Share of eval samples not generated by the pinned version (must be 0).",
    ["run"], registry=REGISTRY,
)
EVAL_LAG_STEPS = Gauge(
    "rlfleet_eval_lag_steps", "Training steps taken between a point's step and its result.", ["run"], registry=REGISTRY,
)
EVAL_SNAPSHOT_BYTES = Gauge(
    "rlfleet_eval_snapshot_bytes", "Bytes of eval snapshots on the volume.", ["run"], registry=REGISTRY,
)
EVAL_SNAPSHOTS = Gauge(
    "rlfleet_eval_snapshots", "Eval snapshot directories on the volume.", ["run"], registry=REGISTRY,
)

# --- Operator ---------------------------------------------------------------------------------------
# kind: RolloutFleet, EvalFleet, TrainingRun; outcome: ok, error
OPERATOR_RECONCILES = Counter(
    "rlfleet_operator_reconciles_total", "Reconciles of rlfleet objects by kind and outcome.", ["kind", "outcome"],
    registry=REGISTRY,
)
OPERATOR_RECONCILE_ERRORS = Counter(
    "rlfleet_operator_reconcile_errors_total", "Reconciles that failed (API errors, bad specs).", ["kind", "reason"],
    registry=REGISTRY,
)
OPERATOR_RECONCILE_DURATION = Histogram(
    "rlfleet_operator_reconcile_duration_seconds", "One reconcile, API calls included.", ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY,
)
OPERATOR_RECREATIONS = Counter(
    "rlfleet_operator_engine_recreations_total", "Engine pods the operator recreated after a failure.",
    ["namespace", "fleet"], registry=REGISTRY,
)
OPERATOR_SLOTS_FAILED = Counter(
    "rlfleet_operator_slots_failed_total", "Engine slots given up (restart budget spent).", ["namespace", "fleet"],
    registry=REGISTRY,
)
OPERATOR_READY_ENGINES = Gauge(
    "rlfleet_operator_ready_engines", "Ready engine pods of a fleet at the last reconcile.", ["namespace", "fleet"],
    registry=REGISTRY,
)
# verb: GET, POST, PATCH, DELETE, WATCH (requests of the operator's own client; Kopf's watches not included)
OPERATOR_API_REQUESTS = Counter(
    "rlfleet_operator_api_requests_total", "Kubernetes API requests made by reconciles.", ["verb"],
    registry=REGISTRY,
)

# --- Trackers (spec.tracking) -------------------------------------------------------------------------
# tracker: tensorboard, mlflow; outcome: written, dropped (the tracker failed or was too slow: the run
# went on without it).
TRACKER_RECORDS = Counter(
    "rlfleet_tracker_records", "Per-step records handed to a tracker, by outcome.", ["tracker", "outcome"],
    registry=REGISTRY,
)
