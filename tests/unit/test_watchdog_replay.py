"""`rlfleet watchdog replay`: the seed's conclusions on the committed traces, through the real CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.crds.specs import WatchdogSpec
from rlfleet.orchestrator.guards.watchdog_replay import TraceError, parse_trace, replay, replay_offset

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "benchmarks" / "traces"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.cli", "watchdog", "replay", *args],
                          capture_output=True, text=True, timeout=120)


def rows_by_checks(stdout: str) -> dict[int, dict]:
    return {row["checks"]: row for row in json.loads(stdout)}


def test_healthy_bursty_run_is_stopped_by_six_checks_at_some_offsets_and_never_by_ten():
    done = run_cli(str(TRACES / "healthy-bursty.txt"), "--checks", "6,8,10", "--json")
    assert done.returncode == 0, done.stderr
    rows = rows_by_checks(done.stdout)
    assert 0 < rows[6]["stopped"] < 30  # false alarms at some start offsets, not all
    assert rows[6]["max_strikes_in_a_row"] == 6
    for checks in (8, 10):
        assert rows[checks]["stopped"] == 0
        assert rows[checks]["max_strikes_in_a_row"] < 8
        assert rows[checks]["stopped_after_s_min"] is None and rows[checks]["stopped_after_s_max"] is None
    assert all(row["offsets"] == 30 for row in rows.values())


def test_dead_engine_is_stopped_about_five_minutes_after_its_first_error_at_ten_checks():
    done = run_cli(str(TRACES / "dead-engine.txt"), "--json")
    assert done.returncode == 0, done.stderr
    rows = rows_by_checks(done.stdout)
    assert rows[10]["stopped"] == 30
    assert 270 <= rows[10]["stopped_after_s_min"] <= rows[10]["stopped_after_s_max"] <= 305
    assert 150 <= rows[6]["stopped_after_s_min"] <= rows[6]["stopped_after_s_max"] <= 185


def test_table_output_names_every_column():
    done = run_cli(str(TRACES / "dead-engine.txt"), "--checks", "10")
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()[1:3]
    for column in ("checks", "offsets stopped", "most strikes in a row", "time to stop"):
        assert column in header
    assert row.split()[:4] == ["10", "30", "of", "30"]
    assert row.rstrip().endswith("273 to 302 s")


def test_a_bad_line_is_reported_with_its_number(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("1792271010.5\n2026-10-17T21:03:31Z\n\nnot-a-time\n")
    done = run_cli(str(trace))
    assert done.returncode == 2
    assert "line 4" in done.stderr and "not-a-time" in done.stderr


@pytest.mark.parametrize("args", [["--checks", "0"], ["--checks", "6,x"], ["--limit", "1.5"], ["--offsets", "0"]])
def test_bad_settings_exit_2_with_a_message(args):
    done = run_cli(str(TRACES / "dead-engine.txt"), *args)
    assert done.returncode == 2
    assert "error" in done.stderr or "bad setting" in done.stderr


def test_generator_reproduces_the_committed_traces(tmp_path):
    subprocess.run([sys.executable, str(TRACES / "generate_traces.py"), str(tmp_path)], check=True, timeout=120)
    for name in ("healthy-bursty.txt", "dead-engine.txt"):
        assert (tmp_path / name).read_bytes() == (TRACES / name).read_bytes(), name


def test_epoch_and_iso_times_mean_the_same_instant():
    times = parse_trace(["1792652189.5", "2026-10-22T07:16:29.5Z", "2026-10-22 07:16:29.5+00:00", "# note", ""])
    assert times[0] == pytest.approx(1792652189.5)
    assert times[1] == times[2] == pytest.approx(datetime_epoch("2026-10-22T07:16:29.5+00:00"))


def datetime_epoch(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text).timestamp()


def test_empty_trace_is_an_error():
    with pytest.raises(TraceError, match="no error times"):
        parse_trace(["", "# nothing"])


def test_replay_checks_at_the_offset_phase():
    spec = WatchdogSpec(window_seconds=60, check_interval_seconds=30, limit=10, checks=2)
    times = [1000.0 + i * 0.1 for i in range(3000)]  # 300 s at 10/s
    # offset 0: the first check at the first error sees 1 error; strikes at +30 and +60.
    assert replay_offset(times, spec, 0).stopped_after_s == 60
    # offset 1: 11 errors by +1 s -> strikes at +1 and +31.
    assert replay_offset(times, spec, 1).stopped_after_s == 31
    row = replay(times, spec, offsets=5)
    assert (row.stopped, row.stopped_after_s_min, row.stopped_after_s_max) == (5, 31, 60)
