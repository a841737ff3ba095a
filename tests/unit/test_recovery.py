"""Pure recovery decisions: backoff, budgets, the ready floor, the crash-loop message."""
from __future__ import annotations

import pytest

from rlfleet.crds.specs import RecoverySpec
from rlfleet.policy.recovery import (
    SlotView,
    backoff_delay,
    backoff_schedule,
    crash_loop_message,
    engine_error_line,
    plan_recovery,
)

SPEC = RecoverySpec(max_restarts_per_engine=3, max_restarts_per_run=5, backoff_base_seconds=1,
                    backoff_max_seconds=10)


def test_backoff_doubles_from_base_and_is_capped():
    assert backoff_schedule(SPEC, 6) == [1, 2, 4, 8, 10, 10]
    assert backoff_delay(10_000, SPEC) == 10
    assert backoff_delay(0, RecoverySpec(backoff_base_seconds=0)) == 0
    with pytest.raises(ValueError):
        backoff_delay(-1, SPEC)


def test_dead_slot_is_recreated_after_its_backoff():
    plan = plan_recovery([SlotView(0, dead=True, failed=False, restarts=2, dead_since=100.0),
                          SlotView(1, dead=False, failed=False, restarts=0)],
                         spec=SPEC, run_restarts=2, min_ready=2, now=101.0)
    assert plan.recreate == {0: 104.0}  # dead at 100 + 4 s (third recreation)
    assert not plan.give_up and not plan.fleet_failed


def test_slot_budget_spent_gives_the_slot_up_and_fails_below_the_floor():
    views = [SlotView(0, dead=True, failed=False, restarts=3, dead_since=0.0),
             SlotView(1, dead=False, failed=False, restarts=0)]
    plan = plan_recovery(views, spec=SPEC, run_restarts=3, min_ready=2, now=0.0)
    assert 0 in plan.give_up and "3 per engine" in plan.give_up[0]
    assert plan.fleet_failed
    # With minReadyEngines=1 the run goes on with one engine.
    plan = plan_recovery(views, spec=SPEC, run_restarts=3, min_ready=1, now=0.0)
    assert 0 in plan.give_up and not plan.fleet_failed and plan.serviceable == 1


def test_run_budget_is_shared_in_slot_order():
    views = [SlotView(n, dead=True, failed=False, restarts=0, dead_since=0.0) for n in range(3)]
    plan = plan_recovery(views, spec=SPEC, run_restarts=4, min_ready=1, now=0.0)
    assert list(plan.recreate) == [0]
    assert set(plan.give_up) == {1, 2} and "5 per run" in plan.give_up[1]


def test_failed_slots_do_not_count_towards_the_floor():
    views = [SlotView(0, dead=False, failed=True, restarts=3), SlotView(1, dead=False, failed=False, restarts=0)]
    assert plan_recovery(views, spec=SPEC, run_restarts=0, min_ready=2, now=0).fleet_failed
    assert not plan_recovery(views, spec=SPEC, run_restarts=0, min_ready=1, now=0).fleet_failed


SGLANG_MISSING_MODEL_TAIL = [
    '  File "/x/huggingface_hub/utils/_validators.py", line 154, in validate_repo_id',
    "    raise HFValidationError(",
    "huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or "
    "'namespace/repo_name': '/no/such/model'. Use `repo_type` argument if needed.",
    "",
    "During handling of the above exception, another exception occurred:",
    "Traceback (most recent call last):",
    '  File "/x/transformers/utils/hub.py", line 511, in cached_files',
    "OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name': '/no/such/model'.",
]


def test_engine_error_line_is_the_last_exception_line():
    assert engine_error_line(SGLANG_MISSING_MODEL_TAIL).startswith("OSError: Repo id must be")
    assert engine_error_line(["starting", "loading weights"]) is None
    assert engine_error_line(["[2026-01-01 10:00:00] ERROR: [Errno 98] address already in use"]).endswith(
        "address already in use")


def test_crash_loop_message_quotes_exit_code_error_line_and_log_tail():
    message = crash_loop_message(fleet="rollout", slot=0, why="slot 0 used its restart budget (3 per engine)",
                                 starts=4, exit_code=1, last_failure="process exited with code 1",
                                 log_tail=SGLANG_MISSING_MODEL_TAIL, log_path="/runs/x/slot-0/incarnation-4.log")
    first = message.splitlines()[0]
    assert "engine slot 0" in first and "4 start(s)" in first and "last exit code 1" in first
    assert "engine error: OSError: Repo id must be in the form" in message
    assert "incarnation-4.log" in message and "HFValidationError" in message


def test_dead_slot_decision_checks_the_slot_budget_then_the_run_budget_then_the_backoff():
    from rlfleet.policy.recovery import GiveUp, decide_dead_slot

    def decide(restarts, budget_left, dead_since=100.0, now=101.0):
        return decide_dead_slot(restarts=restarts, run_budget_left=budget_left, dead_since=dead_since, now=now,
                                spec=SPEC)

    assert decide(3, 0).give_up is GiveUp.ENGINE_BUDGET and decide(3, 0).recreate_at is None
    assert decide(2, 0).give_up is GiveUp.RUN_BUDGET
    assert decide(2, 1) == decide(2, 5) and decide(2, 1).recreate_at == 104.0  # dead at 100 + 4 s
    assert decide(0, 1, dead_since=50.0).recreate_at == 101.0  # backoff long over: due now, not in the past
    assert decide(1, 1, dead_since=None).recreate_at == 103.0  # death time unknown: counted from now
