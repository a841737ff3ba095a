"""Status models: the short text the kubectl columns show, and timestamps."""
from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from rlfleet.crds.status import Condition, LastEvalStatus, TrainingRunStatus, now_rfc3339


def test_ready_column_text_follows_the_counts():
    assert TrainingRunStatus(ready_engines=1, total_engines=2).ready == "1/2"
    assert TrainingRunStatus().ready is None


def test_last_eval_summary_names_scores_or_the_skip():
    assert LastEvalStatus(step=10, scores={"reverse": 0.25, "add": 0.5}).summary == "@10 add=0.5 reverse=0.25"
    assert LastEvalStatus(step=20, skipped_reason="pin_violation", skipped={"pin_violation": 1}).summary == (
        "@20 skipped pin_violation"
    )


def test_condition_times_and_reasons_are_checked():
    Condition(type="Ready", status="True", reason="EnginesReady", last_transition_time="2026-01-01T00:00:00Z")
    with pytest.raises(ValidationError, match="RFC 3339"):
        Condition(type="Ready", status="True", reason="EnginesReady", last_transition_time="yesterday")
    with pytest.raises(ValidationError, match="reason"):
        Condition(type="Ready", status="True", reason="engines ready", last_transition_time="2026-01-01T00:00:00Z")
    with pytest.raises(ValidationError, match="type"):
        Condition(type="Healthy", status="True", reason="X", last_transition_time="2026-01-01T00:00:00Z")


def test_now_is_a_kubernetes_timestamp():
    assert now_rfc3339(datetime(2026, 1, 2, 3, 4, 5, 999, tzinfo=UTC)) == "2026-01-02T03:04:05Z"
    assert now_rfc3339().endswith("Z")
