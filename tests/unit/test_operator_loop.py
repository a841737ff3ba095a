"""The operator's reconcile loop: which failures are expected (a warning) and which are bugs (logged
with their traceback). One pass of the real loop, its retry wait skipped."""
import logging

import kopf
import pytest
from pydantic import ValidationError

from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.kube.client import ApiError
from rlfleet.operator import handlers

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

    await handlers._loop(KEY, "RolloutFleet", memo, stopped, once)


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
