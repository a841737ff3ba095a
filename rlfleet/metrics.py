"""Every Prometheus metric rlfleet exports, defined once (the names are API).

Prefix `rlfleet_`; counters end in `_total`; durations are histograms in `_seconds`. Dashboards and
alert rules may only query names defined here.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# --- Rollout request path -------------------------------------------------------------------------
# One per request (sample) when it settles: ok, failed (retries exhausted or not retryable), deadline.
ROLLOUT_REQUESTS = Counter(
    "rlfleet_rollout_requests_total", "Rollout requests (samples) by final outcome.", ["fleet", "outcome"]
)
# One per HTTP attempt, by what happened: ok, unavailable (503), connection, timeout, server_error,
# client_error, aborted (HTTP 200 with finish_reason abort), duplicate_rid.
ROLLOUT_ATTEMPTS = Counter(
    "rlfleet_rollout_attempts_total", "Rollout HTTP attempts through the router by result.", ["fleet", "result"]
)
ROLLOUT_REQUEST_DURATION = Histogram(
    "rlfleet_rollout_request_duration_seconds", "Time from first attempt to final outcome of a rollout request.",
    ["fleet"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)

# --- 503 watchdog ---------------------------------------------------------------------------------
WATCHDOG_STRIKES = Counter(
    "rlfleet_watchdog_strikes_total", "Watchdog checks whose window held more failures than the limit.", ["fleet"]
)
WATCHDOG_TRIPS = Counter(
    "rlfleet_watchdog_trips_total", "Times the watchdog saw its number of strikes in a row.", ["fleet"]
)
WATCHDOG_STRIKES_IN_A_ROW = Gauge(
    "rlfleet_watchdog_strikes_in_a_row", "Current run of consecutive watchdog strikes.", ["fleet"]
)
WATCHDOG_WINDOW_FAILURES = Gauge(
    "rlfleet_watchdog_window_failures", "Failed rollout requests in the window at the last check.", ["fleet"]
)

# --- Heat guard -----------------------------------------------------------------------------------
HEAT_GUARD_PAUSES = Counter(
    "rlfleet_heat_guard_pauses_total", "Generation pauses by the heat guard.", ["fleet", "slot"]
)
# Its _sum is the paused seconds, its _count the finished pauses.
HEAT_GUARD_PAUSE_DURATION = Histogram(
    "rlfleet_heat_guard_pause_duration_seconds", "Length of finished heat-guard pauses.", ["fleet", "slot"],
    buckets=(5, 15, 30, 45, 60, 90, 120, 180, 300, 600),
)
HEAT_GUARD_PAUSED = Gauge(
    "rlfleet_heat_guard_paused", "1 while the heat guard holds generation paused on the engine.", ["fleet", "slot"]
)
GPU_TEMPERATURE = Gauge(
    "rlfleet_gpu_temperature_celsius", "Last GPU temperature read for the engine.", ["fleet", "slot"]
)
HEAT_GUARD_READ_ERRORS = Counter(
    "rlfleet_heat_guard_read_errors_total", "Temperature reads that failed.", ["fleet", "source"]
)
HEAT_GUARD_ACTION_ERRORS = Counter(
    "rlfleet_heat_guard_action_errors_total", "Pause/continue calls to an engine that failed.", ["fleet", "slot", "action"]
)
STEPS_OVERLAPPING_PAUSE = Counter(
    "rlfleet_steps_overlapping_heat_pause_total", "Training steps that overlapped a heat-guard pause.", ["fleet"]
)
