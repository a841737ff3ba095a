"""Pure recovery decisions: restart budgets, exponential backoff, crash loops, the ready floor.

A dead slot is recreated, held back or given up by `decide_dead_slot`, whoever recreates it: the local
backend (through `plan_recovery`) and the operator, which recreates the Kubernetes backend's pods
(`rlfleet.operator.fleet_decide`). So a slot is recreated after the same backoff, and given up for
the same budgets, in both modes. The Kubernetes backend itself decides nothing here: it reports
what the operator did.

Deciding a slot, the two differ only in how they count the run budget left: the local backend
commits a recreation when it plans it (it then sleeps out the backoff), so a planned one is spent at
once; the operator decides again on every reconcile from the cluster, so only recreations done are
spent. Whether the whole fleet failed is `plan_recovery`'s ready floor locally, and the fleet's
Failed condition (`fleet_decide.fleet_conditions`) on Kubernetes.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from rlfleet.crds.specs import RecoverySpec


def exponential_backoff(n: int, base: float, cap: float) -> float:
    """base, 2*base, 4*base, ... for n = 0, 1, 2, ..., capped at `cap` (the one backoff rule)."""
    if n < 0:
        raise ValueError(f"restarts must be >= 0, got {n}")
    exponent = min(n, 60)  # 2**60 * base overflows any sane cap long before
    return min(cap, base * (2 ** exponent))


def backoff_delay(restarts: int, spec: RecoverySpec) -> float:
    """Seconds to wait before recreating a slot that has been recreated `restarts` times already.

    base, 2*base, 4*base, ... capped at backoff_max_seconds.
    """
    return exponential_backoff(restarts, spec.backoff_base_seconds, spec.backoff_max_seconds)


def backoff_schedule(spec: RecoverySpec, recreations: int) -> list[float]:
    """The delays before each of the first `recreations` recreations of one slot."""
    return [backoff_delay(n, spec) for n in range(recreations)]


class GiveUp(StrEnum):
    """Why a dead slot is not recreated."""

    ENGINE_BUDGET = "engine_budget"  # the slot used maxRestartsPerEngine
    RUN_BUDGET = "run_budget"  # the fleet used maxRestartsPerRun


@dataclass(frozen=True)
class SlotDecision:
    """What to do with one dead slot: recreate it at `recreate_at`, or give it up (`give_up`)."""

    recreate_at: float | None = None
    give_up: GiveUp | None = None


def decide_dead_slot(*, restarts: int, run_budget_left: int, dead_since: float | None, now: float,
                     spec: RecoverySpec) -> SlotDecision:
    """The restart policy of one dead slot, recreated `restarts` times so far.

    Out of its own budget, or of the run's: give it up. Otherwise recreate it once its backoff since
    it died has passed (`recreate_at` is never before `now`; a slot of unknown death time is due now).
    """
    if restarts >= spec.max_restarts_per_engine:
        return SlotDecision(give_up=GiveUp.ENGINE_BUDGET)
    if run_budget_left <= 0:
        return SlotDecision(give_up=GiveUp.RUN_BUDGET)
    since = dead_since if dead_since is not None else now
    return SlotDecision(recreate_at=max(now, since + backoff_delay(restarts, spec)))


@dataclass(frozen=True)
class SlotView:
    """What the planner needs to know about one slot."""

    slot: int
    dead: bool  # dead and not yet recreated
    failed: bool  # given up for good
    restarts: int  # recreations so far
    dead_since: float | None = None


@dataclass
class RecoveryPlan:
    recreate: dict[int, float] = field(default_factory=dict)  # slot -> time it may be recreated
    give_up: dict[int, str] = field(default_factory=dict)  # slot -> why it will not be recreated
    fleet_failed: bool = False  # fewer than min_ready slots can ever serve again
    serviceable: int = 0  # slots that are alive, starting or still recreatable


def plan_recovery(slots: Iterable[SlotView], *, spec: RecoverySpec, run_restarts: int, min_ready: int,
                  now: float) -> RecoveryPlan:
    """Decide, for every dead slot, to recreate it (when) or give it up; and whether the fleet failed.

    Slots are considered in slot order, so when the run budget runs short the lowest slots get it.
    """
    plan = RecoveryPlan()
    budget_left = spec.max_restarts_per_run - run_restarts
    for view in sorted(slots, key=lambda v: v.slot):
        if view.failed:
            continue
        if not view.dead:
            plan.serviceable += 1
            continue
        decision = decide_dead_slot(restarts=view.restarts, run_budget_left=budget_left,
                                    dead_since=view.dead_since, now=now, spec=spec)
        if decision.recreate_at is None:
            plan.give_up[view.slot] = (
                f"slot {view.slot} used its restart budget ({spec.max_restarts_per_engine} per engine)"
                if decision.give_up is GiveUp.ENGINE_BUDGET
                else f"the run used its restart budget ({spec.max_restarts_per_run} per run)")
            continue
        budget_left -= 1  # committed now: the backend sleeps out the backoff, then recreates
        plan.recreate[view.slot] = decision.recreate_at
        plan.serviceable += 1
    plan.fleet_failed = plan.serviceable < min_ready
    return plan


@dataclass(frozen=True)
class RouterRestart:
    """Restart the router after `delay_s` (its `attempt`-th restart in this run)."""

    delay_s: float
    attempt: int


@dataclass(frozen=True)
class RouterGiveUp:
    why: str


def plan_router_restart(restarts: int, *, max_restarts: int, spec: RecoverySpec) -> RouterRestart | RouterGiveUp:
    """A fleet's router exited after `restarts` restarts so far: restart it (when) or give up.

    The budget is the router spec's maxRestarts; the backoff is the fleet's recovery backoff.
    """
    if restarts >= max_restarts:
        return RouterGiveUp(f"the router used its restart budget ({max_restarts} per run)" if max_restarts
                            else "the router may not be restarted (maxRestarts 0)")
    return RouterRestart(delay_s=0.0 if restarts == 0 else backoff_delay(restarts - 1, spec), attempt=restarts + 1)


# Lines that carry an engine's own error (Python exceptions, SGLang's fatal messages).
_ERROR_LINE = re.compile(r"(^\w+(\.\w+)*(Error|Exception|Exit)\b.*:)|(\b(ERROR|FATAL|CRITICAL)\b)|"
                         r"(^(RuntimeError|OSError|ValueError|AssertionError|KeyError)\b)")


def engine_error_line(log_tail: list[str]) -> str | None:
    """The last line of a log tail that states an error (the exception line of a traceback)."""
    for line in reversed(log_tail):
        stripped = line.strip()
        if _ERROR_LINE.search(stripped):
            return stripped
    return None


def crash_loop_message(*, fleet: str, slot: int, why: str, starts: int, exit_code: int | None,
                       last_failure: str | None, log_tail: list[str], log_path: str | None) -> str:
    """The FleetFailed message: what gave up, the engine's own error line, then its last log lines."""
    parts = [f"fleet {fleet}: engine slot {slot} cannot be kept running: {why}; {starts} start(s)"]
    if exit_code is not None:
        parts.append(f"last exit code {exit_code}")
    if last_failure:
        parts.append(f"last failure: {last_failure}")
    head = ", ".join(parts) + "."
    error = engine_error_line(log_tail)
    lines = [head]
    if error:
        lines.append(f"engine error: {error}")
    where = f" ({log_path})" if log_path else ""
    lines.append(f"last log lines{where}:")
    lines.extend("    " + line for line in (log_tail or ["(empty log)"]))
    return "\n".join(lines)
