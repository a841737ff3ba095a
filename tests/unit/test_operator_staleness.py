"""The versions a reconcile's own status writes leave behind, and the bounded wait for a body showing one."""
from __future__ import annotations

from rlfleet.operator.staleness import STALE_WAIT_MAX_S, LeftBehind, superseded


def test_a_pass_that_wrote_twice_leaves_its_start_and_first_write_behind():
    assert superseded("10", ["11", "12"]) == {"10", "11"}


def test_a_pass_that_wrote_once_leaves_its_start_behind():
    assert superseded("10", [None, "12"]) == {"10"}
    assert superseded("10", ["11", None]) == {"10"}


def test_a_pass_that_wrote_nothing_leaves_nothing_behind():
    assert superseded("10", [None, None]) == frozenset()
    assert superseded(None, ["11"]) == frozenset()


def test_a_body_showing_a_superseded_version_is_put_off_for_a_bounded_time():
    left = LeftBehind(superseded("10", ["11", "12"]), until=100.0 + STALE_WAIT_MAX_S)
    assert left.puts_off("11", now=100.0) and left.puts_off("10", now=100.0)
    assert not left.puts_off("12", now=100.0)  # the newest write: reconciled
    assert not left.puts_off("13", now=100.0)  # someone else's change: reconciled
    assert not left.puts_off("11", now=100.0 + STALE_WAIT_MAX_S)  # a watch that never delivers stops nothing
