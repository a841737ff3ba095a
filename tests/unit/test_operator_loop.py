"""The operator's reconcile loop: which failures are expected (a warning) and which are bugs (logged
with their traceback). One pass of the real loop, its retry wait skipped."""
import asyncio
import logging

import kopf
import pytest
from pydantic import ValidationError

from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.kube.client import ApiError
from rlfleet.operator import handlers
from rlfleet.operator.run_decide import RunPlan
from rlfleet.operator.staleness import STALE_WAIT_MAX_S

KEY = ("fleet", "ns", "f")


def bad_body_error() -> ValidationError:
    try:
        FleetSpec.model_validate({"replicas": -1})
    except ValidationError as e:
        return e
    raise AssertionError("the spec validated")


async def one_failing_pass(error: Exception) -> None:
    memo = kopf.Memo(triggers={})
    stopped: list[bool] = []

    async def once():
        stopped.append(True)  # this pass is the last
        memo.triggers[KEY].set()  # and its retry wait ends at once
        raise error

    await handlers._loop(KEY, "RolloutFleet", memo, stopped, {"metadata": {}}, once)


@pytest.mark.parametrize("error", [KeyError("engine"), ValueError("bad value"), TypeError("bug")],
                         ids=["KeyError", "ValueError", "TypeError"])
async def test_a_bug_is_logged_as_an_error_with_its_traceback(caplog, error):
    with caplog.at_level(logging.WARNING, logger="rlfleet.operator"):
        await one_failing_pass(error)
    (record,) = [r for r in caplog.records if "reconcile failed" in r.getMessage()]
    assert record.levelno == logging.ERROR and record.exc_info and record.exc_info[1] is error


@pytest.mark.parametrize("error", [ApiError(409, "Conflict"), bad_body_error()], ids=["ApiError", "ValidationError"])
async def test_an_expected_failure_is_a_warning_without_traceback(caplog, error):
    with caplog.at_level(logging.WARNING, logger="rlfleet.operator"):
        await one_failing_pass(error)
    (record,) = [r for r in caplog.records if "reconcile failed" in r.getMessage()]
    assert record.levelno == logging.WARNING and not record.exc_info


@pytest.mark.looptime
async def test_a_body_still_showing_a_status_the_loop_replaced_waits_for_the_newer_one():
    """The watch may deliver the loop's own status writes after its next pass begins: a pass on such a
    body would decide from the replaced status (a refused child created and refused again)."""
    memo = kopf.Memo(triggers={})
    stopped: list[bool] = []
    body = {"metadata": {"resourceVersion": "5"}}
    seen: list[str] = []

    async def once():
        seen.append(body["metadata"]["resourceVersion"])
        if len(seen) == 2:
            stopped.append(True)
        memo.triggers[KEY].set()  # wake up at once, as the watch does on every change
        return RunPlan(status={}, superseded_versions=frozenset({"5", "6"}))

    task = asyncio.create_task(handlers._loop(KEY, "TrainingRun", memo, stopped, body, once))
    await asyncio.sleep(2)
    assert seen == ["5"]  # put off while the body shows the versions its own writes replaced
    body["metadata"]["resourceVersion"] = "7"
    await asyncio.wait_for(task, 5)
    assert seen == ["5", "7"]


@pytest.mark.looptime
async def test_a_stale_body_is_reconciled_anyway_once_the_wait_runs_out():
    memo = kopf.Memo(triggers={})
    stopped: list[bool] = []
    calls: list[float] = []
    loop = asyncio.get_running_loop()

    async def once():
        calls.append(loop.time())
        if len(calls) == 2:
            stopped.append(True)
        memo.triggers[KEY].set()
        return RunPlan(status={}, superseded_versions=frozenset({"5"}))

    await asyncio.wait_for(handlers._loop(KEY, "TrainingRun", memo, stopped, {"metadata": {"resourceVersion": "5"}},
                                          once), 60)
    assert STALE_WAIT_MAX_S <= calls[1] - calls[0] < STALE_WAIT_MAX_S + 1
