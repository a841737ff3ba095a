"""The 503 watchdog: the pure rule, and the task that runs it on the loop clock (looptime)."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from rlfleet.crds.specs import WatchdogSpec
from rlfleet.orchestrator.guards.watchdog import RolloutEnginesUnavailable, WatchdogRule, WatchdogTask

SPEC = WatchdogSpec()  # window 60, every 30 s, limit 100, 10 checks


def feed(rule: WatchdogRule, start: float, end: float, per_second: int) -> None:
    """per_second failures spread evenly over [start, end)."""
    n = int((end - start) * per_second)
    for i in range(n):
        rule.record_failure(start + i / per_second)


def test_defaults_are_the_seed_settings():
    assert (SPEC.window_seconds, SPEC.check_interval_seconds, SPEC.limit, SPEC.checks) == (60, 30, 100, 10)


@pytest.mark.parametrize("bad", [{"checks": 0}, {"checks": 2.5}, {"limit": "many"}, {"limit": -1},
                                 {"windowSeconds": 0}, {"checkIntervalSeconds": 1.5}])
def test_bad_settings_are_rejected_when_the_spec_is_built(bad):
    with pytest.raises(ValidationError):
        WatchdogSpec.model_validate(bad)


def test_count_above_limit_is_a_strike_and_at_limit_is_not():
    rule = WatchdogRule(WatchdogSpec(limit=100, checks=3))
    for i in range(100):
        rule.record_failure(10 + i * 0.1)
    assert not rule.check(30).strike  # exactly 100: not above the limit
    rule.record_failure(30)
    result = rule.check(30)
    assert result.strike and result.failures_in_window == 101 and result.strikes_in_a_row == 1


def test_window_excludes_failures_older_than_window():
    rule = WatchdogRule(WatchdogSpec(window_seconds=60, limit=0, checks=5))
    rule.record_failure(0.0)
    assert rule.check(59.9).failures_in_window == 1
    assert rule.check(60.0).failures_in_window == 0  # (now - 60, now]


def test_trips_after_checks_strikes_in_a_row_not_before():
    rule = WatchdogRule(SPEC)
    results = []
    for k in range(1, 11):  # a dead engine: 50 failures every second
        feed(rule, 30 * (k - 1), 30 * k, per_second=50)
        results.append(rule.check(30 * k))
    assert [r.strikes_in_a_row for r in results] == list(range(1, 11))
    assert [r.tripped for r in results] == [False] * 9 + [True]


def test_a_quiet_check_resets_the_run_of_strikes():
    rule = WatchdogRule(WatchdogSpec(checks=3))
    feed(rule, 0, 60, per_second=10)  # 600 in the first minute
    assert rule.check(30).strike and rule.check(60).strike
    assert not rule.check(120).strike  # window (60, 120] is empty
    feed(rule, 121, 180, per_second=10)
    assert rule.check(150).strikes_in_a_row == 1
    assert not rule.tripped


def test_bursts_45s_apart_reach_six_strikes_but_never_ten():
    """The seed's healthy run: two bursts with a 45 s gap keep every 60 s window above the limit."""
    bursts = [t / 30 for t in range(0, 35 * 30)] + [80 + t / 30 for t in range(0, 35 * 30)]
    for phase in range(30):
        rule = WatchdogRule(WatchdogSpec(checks=10))
        pending = list(bursts)
        most = 0
        for k in range(20):
            now = phase + 30 * k
            while pending and pending[0] <= now:
                rule.record_failure(pending.pop(0))
            most = max(most, rule.check(now).strikes_in_a_row)
        assert 5 <= most <= 6
        assert not rule.tripped


def test_memory_stays_bounded_by_one_window_during_a_storm():
    rule = WatchdogRule(SPEC)
    feed(rule, 0, 3600, per_second=50)  # an hour of storm, never checked
    assert rule.failures_in_window(3600) <= 60 * 50


def test_reset_forgets_failures_and_strikes():
    rule = WatchdogRule(WatchdogSpec(checks=1))
    feed(rule, 0, 10, per_second=20)
    assert rule.check(10).tripped
    rule.reset()
    assert not rule.tripped and rule.strikes_in_a_row == 0 and rule.failures_in_window(10) == 0


# --- the task ---------------------------------------------------------------------------------------

class Fleet:
    """What the task needs from the orchestrator, recorded. `can_serve` stands for the one-token
    generation through the router."""

    def __init__(self, serves_after_recovery: bool):
        self.serves_after_recovery = serves_after_recovery
        self.recoveries: list[float] = []

    async def recover(self) -> None:
        self.recoveries.append(asyncio.get_running_loop().time())
        await asyncio.sleep(5)  # recreating engines takes time

    async def can_serve(self) -> bool:
        return self.serves_after_recovery

    def engine_logs(self):
        return {"rollout-0": ["loading model", "AssertionError: FlashAttention v3 Backend requires SM>=80"],
                "rollout-1": []}


async def storm(task: WatchdogTask, per_second: int, until: float) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        for _ in range(per_second):
            task.record_failure()
        await asyncio.sleep(1)


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name, {"fleet": "wd-test"}) or 0.0


@pytest.mark.looptime
async def test_dead_engine_fails_the_run_with_engine_logs_after_ten_checks():
    fleet = Fleet(serves_after_recovery=False)
    task = WatchdogTask(SPEC, recover=fleet.recover, can_serve=fleet.can_serve,
                        engine_logs=fleet.engine_logs, fleet="wd-test")
    strikes_before, trips_before = sample("rlfleet_watchdog_strikes_total"), sample("rlfleet_watchdog_trips_total")
    loop = asyncio.get_running_loop()
    feeder = asyncio.create_task(storm(task, 50, until=10_000))
    with pytest.raises(RolloutEnginesUnavailable) as info:
        await task.run()
    feeder.cancel()
    # Ten checks at 30 s: trip at 300 s, one recovery (5 s), then the failure.
    assert fleet.recoveries == [300]
    assert loop.time() == 305
    exc = info.value
    assert exc.reason == "RolloutEnginesUnavailable"
    assert "AssertionError: FlashAttention v3 Backend requires SM>=80" in exc.message
    assert "[rollout-1] (empty log)" in exc.message
    assert "10 checks in a row" in exc.message
    assert sample("rlfleet_watchdog_strikes_total") - strikes_before == 10
    assert sample("rlfleet_watchdog_trips_total") - trips_before == 1


@pytest.mark.looptime
async def test_successful_recovery_starts_the_count_over():
    fleet = Fleet(serves_after_recovery=True)
    task = WatchdogTask(SPEC, recover=fleet.recover, can_serve=fleet.can_serve,
                        engine_logs=fleet.engine_logs, fleet="wd-test")
    loop = asyncio.get_running_loop()
    feeder = asyncio.create_task(storm(task, 50, until=340))  # recovery works: the storm dies down by 340 s
    runner = asyncio.create_task(task.run())
    await asyncio.sleep(2000)
    assert not runner.done()
    assert fleet.recoveries == [300] and task.trips == 1
    assert task.rule.strikes_in_a_row == 0
    runner.cancel()
    feeder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert loop.time() == 2000


@pytest.mark.looptime
async def test_bursty_healthy_run_never_trips():
    fleet = Fleet(serves_after_recovery=False)
    task = WatchdogTask(SPEC, recover=fleet.recover, can_serve=fleet.can_serve,
                        engine_logs=fleet.engine_logs, fleet="wd-test")
    runner = asyncio.create_task(task.run())

    async def bursts():
        for _ in range(10):
            await storm(task, 30, until=asyncio.get_running_loop().time() + 35)
            await asyncio.sleep(45)
            await storm(task, 30, until=asyncio.get_running_loop().time() + 35)
            await asyncio.sleep(240)

    await bursts()
    assert not runner.done() and fleet.recoveries == [] and task.trips == 0
    runner.cancel()


@pytest.mark.looptime
async def test_a_hanging_recovery_is_bounded():
    async def recover_forever():
        await asyncio.Event().wait()

    async def cannot_serve():
        return False

    task = WatchdogTask(WatchdogSpec(checks=1, limit=0), recover=recover_forever, can_serve=cannot_serve,
                        engine_logs=lambda: {}, fleet="wd-test", recovery_timeout_s=60)
    task.record_failure()
    with pytest.raises(RolloutEnginesUnavailable) as info:
        await task.run()
    assert asyncio.get_running_loop().time() == 30 + 60
    assert "no engine log available" in info.value.message


def spec_logs():
    return {"rollout-0": ["serving"], "router": ["ERROR connection refused", "router exited"]}


@pytest.mark.looptime
async def test_a_recovery_that_does_not_restore_the_router_probe_fails_the_run():
    """The engines are fine (the recovery's weight sync works) but nothing answers through the router."""
    synced = []

    async def recover() -> None:
        synced.append(asyncio.get_running_loop().time())

    async def probe_through_router() -> bool:
        return False

    task = WatchdogTask(SPEC, recover=recover, can_serve=probe_through_router, engine_logs=spec_logs, fleet="wd-test")
    failed_before = REGISTRY.get_sample_value("rlfleet_watchdog_recoveries_total",
                                              {"fleet": "wd-test", "verdict": "failed"}) or 0.0
    feeder = asyncio.create_task(storm(task, 50, until=10_000))
    with pytest.raises(RolloutEnginesUnavailable) as info:
        await task.run()
    feeder.cancel()
    assert synced == [300] and asyncio.get_running_loop().time() == 300
    assert "through the router" in info.value.message
    assert "[router] last log lines:" in info.value.message and "router exited" in info.value.message
    assert REGISTRY.get_sample_value("rlfleet_watchdog_recoveries_total",
                                     {"fleet": "wd-test", "verdict": "failed"}) - failed_before == 1


@pytest.mark.looptime
async def test_failures_continuing_past_the_next_window_after_a_recovery_fail_the_run():
    """The probe passed once, but the storm goes on: the run fails one window after the next, not never."""
    fleet = Fleet(serves_after_recovery=True)
    task = WatchdogTask(SPEC, recover=fleet.recover, can_serve=fleet.can_serve, engine_logs=spec_logs, fleet="wd-test")
    feeder = asyncio.create_task(storm(task, 50, until=100_000))
    with pytest.raises(RolloutEnginesUnavailable) as info:
        await task.run()
    feeder.cancel()
    assert fleet.recoveries == [300]
    # Recovered at 305; checks every 30 s from there; the first whose window starts 60 s after it is at 425.
    assert asyncio.get_running_loop().time() == 425
    assert "failures continued past the next window" in info.value.message


@pytest.mark.looptime
async def test_two_trips_within_the_period_fail_the_run():
    fleet = Fleet(serves_after_recovery=True)
    task = WatchdogTask(SPEC, recover=fleet.recover, can_serve=fleet.can_serve, engine_logs=spec_logs, fleet="wd-test")
    assert SPEC.retrip_period() == 2 * 10 * 30

    async def two_storms() -> None:
        await storm(task, 50, until=300)  # trips at 300, recovered at 305
        await asyncio.sleep(130)  # quiet long enough to pass the next-window check at 425
        await storm(task, 50, until=100_000)  # from 430 on: strikes again, trips at 725

    feeder = asyncio.create_task(two_storms())
    with pytest.raises(RolloutEnginesUnavailable) as info:
        await task.run()
    feeder.cancel()
    assert fleet.recoveries == [300] and task.trips == 2
    assert asyncio.get_running_loop().time() == 725
    assert "tripped again 420 s after a recovery" in info.value.message


@pytest.mark.looptime
async def test_a_trip_after_the_period_gets_its_own_recovery():
    fleet = Fleet(serves_after_recovery=True)
    spec = WatchdogSpec(retrip_period_seconds=400)
    task = WatchdogTask(spec, recover=fleet.recover, can_serve=fleet.can_serve, engine_logs=spec_logs, fleet="wd-test")

    async def two_storms() -> None:
        await storm(task, 50, until=300)
        await asyncio.sleep(130)
        await storm(task, 50, until=760)  # trips again at 725 (420 s after the recovery at 305 > 400)

    feeder = asyncio.create_task(two_storms())
    runner = asyncio.create_task(task.run())
    await asyncio.sleep(1500)
    assert not runner.done(), runner
    assert fleet.recoveries == [300, 725] and task.trips == 2 and task.recoveries == 2
    runner.cancel()
    feeder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner


def test_the_retrip_period_defaults_to_twice_the_time_to_trip_and_is_validated():
    assert WatchdogSpec(checks=4, check_interval_seconds=15, window_seconds=30).retrip_period() == 120
    assert WatchdogSpec(retrip_period_seconds=300).retrip_period() == 300
    with pytest.raises(ValidationError):
        WatchdogSpec.model_validate({"retripPeriodSeconds": 0})
    # A trip after a recovery takes checks x checkIntervalSeconds (300 s by default): a shorter period would
    # never see one, and the recoveries would go unbounded.
    with pytest.raises(ValidationError, match="at least checks x checkIntervalSeconds"):
        WatchdogSpec.model_validate({"retripPeriodSeconds": 299})
