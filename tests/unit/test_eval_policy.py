"""The pure evaluation policy: schedule, admission, snapshot ownership, scoring, status."""
from __future__ import annotations

import pytest

from rlfleet.crds.status import LastEvalStatus
from rlfleet.orchestrator.evaluation.api import EvalSkip
from rlfleet.orchestrator.evaluation.policy import (
    Admission,
    DatasetScore,
    EvalPoint,
    SampleOutcome,
    SnapshotLedger,
    SnapshotOwnershipError,
    admit,
    is_eval_step,
    last_eval_fields,
    mapping_scores,
    overall_mixed_version_ratio,
    planned_eval_steps,
    score_dataset,
    skip_counts,
)


def test_schedule_every_interval_plus_the_initial_model_and_the_final_step():
    assert planned_eval_steps(interval=10, final_step=25, before_train=True) == [0, 10, 20, 25]
    assert planned_eval_steps(interval=10, final_step=20, before_train=False) == [10, 20]
    assert planned_eval_steps(interval=100, final_step=3, before_train=False) == [3]
    assert not is_eval_step(0, interval=1, final_step=5, before_train=False)
    with pytest.raises(ValueError):
        is_eval_step(1, interval=0, final_step=5, before_train=False)


@pytest.mark.parametrize("policy", ["backpressure", "skip"])
def test_admission_starts_while_there_is_room(policy):
    assert admit(1, max_in_flight=2, overflow_policy=policy) is Admission.START


def test_admission_when_full_waits_or_skips_and_a_forced_point_always_waits():
    assert admit(2, max_in_flight=2, overflow_policy="backpressure") is Admission.WAIT
    assert admit(2, max_in_flight=2, overflow_policy="skip") is Admission.SKIP_BUSY
    assert admit(5, max_in_flight=2, overflow_policy="skip", force=True) is Admission.WAIT
    with pytest.raises(ValueError, match="overflow_policy"):
        admit(0, max_in_flight=1, overflow_policy="drop")
    with pytest.raises(ValueError, match="max_in_flight"):
        admit(0, max_in_flight=0, overflow_policy="skip")


def test_ledger_keeps_the_newest_consumed_snapshots_and_deletes_unusable_ones_at_once():
    ledger = SnapshotLedger(keep=2)
    for step in (1, 2, 3, 4):
        ledger.take(step, f"/v/eval/step_{step}")
    assert ledger.retire(2) == []
    assert ledger.retire(1) == []  # settle order, not step order, decides what is newest
    assert ledger.retire(3, usable=False) == ["/v/eval/step_3"]
    assert ledger.retire(4) == ["/v/eval/step_2"]
    assert ledger.kept == ["/v/eval/step_1", "/v/eval/step_4"]
    assert ledger.balanced and ledger.taken == ledger.retired == 4


def test_ledger_refuses_double_ownership_and_double_retirement():
    ledger = SnapshotLedger(keep=1)
    ledger.take(5, "/v/eval/step_5")
    with pytest.raises(SnapshotOwnershipError):
        ledger.take(5, "/v/eval/step_5")
    ledger.retire(5)
    with pytest.raises(SnapshotOwnershipError):
        ledger.retire(5)
    assert ledger.balanced


def test_dataset_score_counts_truncation_failed_rewards_and_foreign_versions():
    outcomes = [
        SampleOutcome(reward=1.0, response_tokens=4, finish="stop", weight_version="7"),
        SampleOutcome(reward=0.5, response_tokens=8, finish="length", weight_version="7"),
        SampleOutcome(reward=None, response_tokens=8, finish="length", weight_version="7"),
        SampleOutcome(reward=0.5, response_tokens=4, finish="stop", weight_version="6"),
    ]
    score = score_dataset("reverse", outcomes, expected_version="7")
    assert score.score == pytest.approx(0.5)
    assert score.samples == 4
    assert score.response_length_mean == 6
    assert score.truncated_ratio == 0.5
    assert score.none_reward_ratio == 0.25
    assert score.mixed_version_ratio == 0.25
    with pytest.raises(ValueError):
        score_dataset("empty", [], expected_version="7")


def test_overall_mixed_version_ratio_is_sample_weighted_and_unknown_for_plain_scores():
    a = DatasetScore("a", 1.0, samples=30, mixed_version_ratio=0.0)
    b = DatasetScore("b", 1.0, samples=10, mixed_version_ratio=0.4)
    assert overall_mixed_version_ratio([a, b]) == pytest.approx(0.1)
    assert overall_mixed_version_ratio(mapping_scores({"x": 0.3}).values()) is None


def test_plain_score_mappings_are_checked():
    assert mapping_scores({"x": 1})["x"].score == 1.0
    with pytest.raises(TypeError, match="'x'"):
        mapping_scores({"x": "high"})
    with pytest.raises(TypeError):
        mapping_scores({"x": True})


def test_points_report_the_summary_fields_and_the_training_run_status():
    points = [
        EvalPoint(step=0, posture="fleet", weight_version="0",
                  datasets={"reverse": DatasetScore("reverse", 0.25, samples=4, mixed_version_ratio=0.0)},
                  lag_steps=1, seconds=2.0, export_seconds=0.1),
        EvalPoint(step=10, posture="fleet", skipped="busy", lag_steps=0),
        EvalPoint(step=20, posture="fleet", skipped="pin_violation", detail="slot 1: refused", lag_steps=2),
        EvalPoint(step=30, posture="fleet", skipped="pin_violation", lag_steps=0),
    ]
    summary = points[0].to_summary()
    assert {k: summary[k] for k in ("step", "weight_version", "posture", "scores", "skipped",
                                     "mixed_version_ratio", "lag_steps", "seconds")} == {
        "step": 0, "weight_version": "0", "posture": "fleet", "scores": {"reverse": 0.25}, "skipped": None,
        "mixed_version_ratio": 0.0, "lag_steps": 1, "seconds": 2.0}
    assert points[2].to_summary()["detail"] == "slot 1: refused"
    assert skip_counts(points) == {"busy": 1, "pin_violation": 2}
    status = LastEvalStatus(**last_eval_fields(points))
    assert status.step == 30 and status.skipped_reason == "pin_violation"
    assert status.skipped == {"busy": 1, "pin_violation": 2}
    assert status.summary == "@30 skipped pin_violation"
    assert last_eval_fields([]) is None


def test_eval_skip_reasons_are_short_words():
    assert EvalSkip("judge_down", "HTTP 502").reason == "judge_down"
    for bad in ("", "two words", "x" * 65):
        with pytest.raises(ValueError):
            EvalSkip(bad)


def test_eval_metrics_are_exported_under_their_api_names():
    from prometheus_client import Counter, Gauge, Histogram

    from rlfleet.observability import metrics

    assert isinstance(metrics.EVAL_SKIPPED, Counter)
    names = {m.describe()[0].name for m in vars(metrics).values() if isinstance(m, (Counter, Gauge, Histogram))}
    for expected in ("rlfleet_eval_in_flight", "rlfleet_eval_duration_seconds", "rlfleet_eval_skipped",
                     "rlfleet_eval_score", "rlfleet_eval_snapshot_bytes", "rlfleet_eval_export_duration_seconds",
                     "rlfleet_eval_mixed_version_ratio", "rlfleet_eval_lag_steps"):
        assert expected in names
