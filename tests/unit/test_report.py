"""The run report's reading of a summary (today's fields and the per-step record's), and where it goes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.observability.report import ReportError, find_summary, load_summary, model, report_path_for, svg

SUMMARY = Path(__file__).resolve().parents[1] / "data" / "quickstart-summary.json"

TODAY = {
    "steps_completed": 3, "steps_planned": 3, "reward_mean_first": 0.1, "reward_mean_last": 0.4,
    "reward_mean_per_step": [0.1, 0.25, 0.4], "engines_marked_dead": 1, "engines_recreated": 1,
    "weight_versions_per_step": {"1": ["0"], "2": ["0", "1"], "3": ["2"]},
    "engine_versions_per_step": {"1": {"0": "1", "1": "1"}, "2": {"1": "2"}, "3": {"0": "3", "1": "3"}},
    "recovered_slots_per_step": {"3": [0]}, "heat_paused_per_step": {"1": False, "2": True, "3": False},
    "weight_sync_per_step": {
        "1": {"mode": "disk", "seconds": 0.5, "phases": {"validate": 0.1, "load": 0.3}, "fallback": None},
        "2": {"mode": "broadcast", "seconds": 0.4, "phases": {"broadcast": 0.4}, "fallback": "transfer"},
        "3": {"mode": "disk", "seconds": 2.5, "phases": {"recover": 2.0, "load": 0.5}, "fallback": None}},
    "eval": [{"step": 0, "scores": {"rotate": 0.0}, "skipped": None},
             {"step": 3, "scores": {}, "skipped": "busy"}],
    "checkpoints": [{"step": 2, "loop_held_seconds": 0.01}], "resumed_from": [], "router_events": ["rollout: exited"],
    "a_field_from_a_newer_version": {"x": 1},
}


def test_todays_summary_reward_eval_sync_phases_events_and_versions():
    report = model.from_summary(TODAY)
    assert report.steps == [1, 2, 3]
    assert report.reward == [(1, 0.1), (2, 0.25), (3, 0.4)]
    assert report.eval_scores == {"rotate": [(0, 0.0)]} and report.eval_skips == [(3, "busy")]
    assert report.time_source == "weight sync phases"
    assert report.step_times == [(1, {"sync validate": 0.1, "sync load": 0.3, "sync other": pytest.approx(0.1)}),
                                 (2, {"sync broadcast": 0.4}), (3, {"sync recover": 2.0, "sync load": 0.5})]
    assert report.time_parts[-1] == "sync other"
    assert [(e.step, e.kind, e.slot) for e in report.events] == [
        (2, "checkpoint", None), (2, "heat_pause", None), (2, "sync_fallback", None), (3, "engine_recreated", "0")]
    assert report.weight_versions == [(1, ["0"]), (2, ["0", "1"]), (3, ["2"])]
    assert report.engine_versions[1] == (2, {"1": "2"})
    assert report.router_events == ["rollout: exited"]
    assert ("engines marked dead / recreated", "1 / 1") in report.facts


def test_per_step_records_give_the_step_phases_and_logged_events():
    data = {**TODAY,
            "records": [{"step": 1, "reward_mean": 0.1, "seconds": 3.0,
                         "phases": {"rollout_wait": 1.0, "train": 0.5, "weight_sync": 0.5}},
                        {"step": 2, "reward_mean": 0.3, "seconds": 2.0,
                         "phases": {"rollout_wait": 1.0, "train": 0.5, "weight_sync": 0.5, "new_phase": 0.0}}],
            "events": [{"kind": "engine_dead", "step": 1, "at": 12.5, "slot": "1", "detail": "exited"},
                       {"kind": "watchdog_strike", "step": 2, "at": 20.0, "slot": None, "detail": ""}]}
    report = model.from_summary(data)
    assert report.steps == [1, 2] and report.reward == [(1, 0.1), (2, 0.3)]
    assert report.time_source == "step phases"
    assert report.time_parts == ["rollout_wait", "train", "weight_sync", "new_phase", "other"]
    assert report.step_times[0] == (1, {"rollout_wait": 1.0, "train": 0.5, "weight_sync": 0.5, "other": 1.0})
    kinds = [(e.step, e.kind, e.slot) for e in report.events]
    assert (1, "engine_dead", "1") in kinds and (2, "watchdog_strike", None) in kinds
    assert (3, "engine_recreated", "0") not in kinds  # the event log, when there is one, is the source


def test_plots_put_every_number_in_data_attributes():
    report = model.from_summary(TODAY)
    page = svg.line_chart("p", "reward", {"reward mean": report.reward}, steps=report.steps)
    assert 'data-step="2" data-value="0.25"' in page
    bars = svg.stacked_bars("b", "time", report.step_times, report.time_parts)
    assert 'data-step="3" data-part="sync recover" data-seconds="2.0"' in bars
    assert svg.nice_ticks(0, 2.6)[-1] >= 2.6 and svg.nice_ticks(0.0, 1.0) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_find_summary_in_a_run_directory(tmp_path):
    with pytest.raises(ReportError, match="no summary JSON"):
        find_summary(tmp_path)
    (tmp_path / "a-summary.json").write_text("{}")
    assert find_summary(tmp_path) == tmp_path / "a-summary.json"
    (tmp_path / "b-summary.json").write_text("{}")
    with pytest.raises(ReportError, match="2 summaries"):
        find_summary(tmp_path)
    with pytest.raises(ReportError, match="not a run summary"):
        load_summary(tmp_path / "a-summary.json")
    assert report_path_for(tmp_path / "a-summary.json") == tmp_path / "a-summary-report.html"


def test_rlfleet_run_writes_the_report_at_the_end_and_prints_its_path(tmp_path, capsys):
    from rlfleet.orchestrator.run import cli
    from rlfleet.orchestrator.run.summary import RunSummary, StepRecord

    async def execute() -> RunSummary:
        return RunSummary(steps_planned=1, steps=[StepRecord(step=1, reward_mean=0.5, weight_versions=["0"],
                                                             seconds=1.0, samples=4)])

    assert cli._finish(execute, report=tmp_path / "run" / "report.html") == 0
    assert f"rlfleet run: report {tmp_path / 'run' / 'report.html'}" in capsys.readouterr().err
    assert 'data-step="1" data-value="0.5"' in (tmp_path / "run" / "report.html").read_text()
    assert (tmp_path / "run" / "report.png").stat().st_size > 0


def test_the_committed_summary_renders():
    report = model.from_summary(json.loads(SUMMARY.read_text()))
    assert report.reward and report.step_times


def test_a_failed_run_writes_its_report_as_far_as_it_got(tmp_path, capsys):
    from rlfleet.orchestrator.run import cli
    from rlfleet.orchestrator.run.loop import RunFailed
    from rlfleet.orchestrator.run.summary import RunSummary, StepRecord

    so_far = RunSummary(steps_planned=5, steps=[StepRecord(step=1, reward_mean=0.25, weight_versions=["0"],
                                                           seconds=1.0, samples=4)],
                        failure="RolloutEnginesUnavailable: no engine left")

    async def execute() -> RunSummary:
        raise RunFailed("RolloutEnginesUnavailable", "no engine left")

    assert cli._finish(execute, report=tmp_path / "report.html", so_far=lambda: so_far) == 1
    assert f"rlfleet run: report {tmp_path / 'report.html'}" in capsys.readouterr().err
    page = (tmp_path / "report.html").read_text()
    assert 'data-step="1" data-value="0.25"' in page and "RolloutEnginesUnavailable: no engine left" in page
