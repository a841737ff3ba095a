"""Every error that ends a run is a RunError carrying its condition reason (pure, no I/O)."""
from __future__ import annotations

import re

import pytest

from rlfleet.errors import RunError
from rlfleet.orchestrator.evaluation.run import EvalSetupError
from rlfleet.orchestrator.fleet.errors import FleetFailed, FleetNotReady, WeightSyncFailed
from rlfleet.orchestrator.guards.watchdog import RolloutEnginesUnavailable
from rlfleet.orchestrator.rollout.producer import RolloutProducerFailed
from rlfleet.orchestrator.run.loop import RunFailed
from rlfleet.snapshot.format import SnapshotInvalid

CAMEL_CASE = re.compile(r"^[A-Z][A-Za-z0-9]*$")


@pytest.mark.parametrize(("error", "reason"), [
    (FleetFailed("crash loop"), "EngineCrashLoop"),
    (FleetFailed("too few", reason="TooFewEngines"), "TooFewEngines"),
    (FleetNotReady("0 of 2 engines alive"), "FleetNotReady"),
    (WeightSyncFailed("1 engine serves it", result=None), "WeightSyncFailed"),
    (SnapshotInvalid("/s/step_3", "no .complete marker"), "SnapshotInvalid"),
    (RolloutEnginesUnavailable("503 storm"), "RolloutEnginesUnavailable"),
    (RolloutProducerFailed("the rollout producer failed: KeyError"), "RolloutProducerFailed"),
    (RolloutProducerFailed("the reward function raised", reason="RewardFunctionFailed"), "RewardFunctionFailed"),
    (EvalSetupError("eval dataset: no such file"), "EvalInvalid"),
    (RunFailed("RolloutTimeout", "only 1 of 2 groups"), "RolloutTimeout"),
])
def test_run_ending_errors_carry_a_camel_case_reason(error, reason):
    assert isinstance(error, RunError)
    assert error.reason == reason and CAMEL_CASE.match(error.reason)


def test_domain_errors_are_not_caught_as_builtin_timeouts_or_value_errors():
    assert not isinstance(FleetNotReady("x"), TimeoutError | OSError)
    assert not isinstance(SnapshotInvalid("d", "p"), ValueError)
    assert not isinstance(EvalSetupError("x"), ValueError)


def test_messages_are_kept():
    assert str(SnapshotInvalid("/s/step_3", "no marker")) == "snapshot /s/step_3 is invalid: no marker"
    failed = RunFailed("ModelNotFound", "no config.json")
    assert str(failed) == "ModelNotFound: no config.json" and failed.message == "no config.json"
