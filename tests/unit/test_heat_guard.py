"""Heat guard: the per-engine rule, the pause ledger, temperature parsing, and the task (looptime)."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from rlfleet.crds.specs import HeatGuardSpec
from rlfleet.orchestrator.guards.heat_guard import EngineHeat, HeatAction, HeatGuardTask, PauseLedger
from rlfleet.orchestrator.guards.heat_sources import (
    FileSource,
    SlotsByGpu,
    SlotsByPod,
    TemperatureReadError,
    parse_dcgm_samples,
    parse_temperature_lines,
)

SPEC = HeatGuardSpec(enabled=True)  # 84 / 74 C, 45..120 s


def test_pauses_at_84_not_below():
    heat = EngineHeat(SPEC)
    assert heat.decide(83.9, 0) is None
    assert heat.decide(84.0, 0).action is HeatAction.PAUSE
    assert heat.decide(None, 0) is None  # no reading: no action


def test_resumes_when_cool_only_after_min_pause():
    heat = EngineHeat(SPEC)
    heat.applied(HeatAction.PAUSE, 100)
    assert heat.decide(60, 144.9) is None  # cool, but the pause is too short
    assert heat.decide(75, 150) is None  # long enough, not cool enough
    decision = heat.decide(74, 145)
    assert (decision.action, decision.reason) == (HeatAction.RESUME, "cooled")
    assert heat.applied(HeatAction.RESUME, 145) == 45
    assert not heat.paused


def test_resumes_after_max_pause_whatever_the_temperature():
    heat = EngineHeat(SPEC)
    heat.applied(HeatAction.PAUSE, 0)
    assert heat.decide(95, 119.9) is None
    assert heat.decide(95, 120).reason == "max_pause"
    assert heat.decide(None, 120).reason == "max_pause"  # no reading does not hold an engine paused


@pytest.mark.parametrize("bad", [dict(pause_at_c=80, resume_at_c=80), dict(min_pause_seconds=200)])
def test_settings_that_would_flap_or_never_resume_are_rejected(bad):
    with pytest.raises(ValidationError, match="resumeAtC must be below pauseAtC|minPauseSeconds must not exceed"):
        HeatGuardSpec(**bad)


def test_ledger_marks_overlap_including_open_pauses():
    ledger = PauseLedger()
    ledger.start("a", 10)
    ledger.end("a", 20)
    ledger.start("b", 50)
    assert ledger.overlapping(0, 9) == set()
    assert ledger.overlapping(0, 10) == {"a"}
    assert ledger.overlapping(15, 16) == {"a"}
    assert ledger.overlapping(21, 49) == set()
    assert ledger.overlapping(60, 70) == {"b"}


def test_temperature_file_lines():
    assert parse_temperature_lines("# slot celsius\nrollout-0 85.5\n\nrollout-1 60\n") == {"rollout-0": 85.5,
                                                                                           "rollout-1": 60.0}
    with pytest.raises(TemperatureReadError, match="line 2"):
        parse_temperature_lines("rollout-0 70\nrollout-1 hot\n")
    with pytest.raises(TemperatureReadError, match="line 1"):
        parse_temperature_lines("rollout-0\n")


DCGM_TEXT = """\
# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-aaa",device="nvidia0",modelName="NVIDIA H100",Hostname="n1",container="engine",namespace="rl",pod="run-rollout-0"} 86
DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-bbb",device="nvidia1",modelName="NVIDIA H100",Hostname="n1",container="engine",namespace="rl",pod="run-rollout-1"} 63
# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-aaa"} 1980
"""  # noqa: E501 - verbatim dcgm-exporter lines


def test_dcgm_exporter_text_by_gpu_index_and_by_pod():
    samples = parse_dcgm_samples(DCGM_TEXT)
    assert [(s.labels["gpu"], s.celsius) for s in samples] == [("0", 86.0), ("1", 63.0)]  # temperatures only
    assert SlotsByGpu({"rollout-0": "1"}).assign(samples).temps == {"rollout-0": 63.0}
    by_pod = SlotsByPod({"run-rollout-1": "rollout-1"}).assign(samples)
    assert by_pod.temps == {"rollout-1": 63.0}  # pods outside the map are not ours
    assert by_pod.unmapped == ("run-rollout-0",)
    with pytest.raises(TemperatureReadError):
        parse_dcgm_samples("DCGM_FI_DEV_GPU_TEMP{gpu=\"0\" 86\n")


async def test_file_source_reads_the_file(tmp_path):
    path = tmp_path / "temps"
    path.write_text("rollout-0 88\n")
    assert await FileSource(path).read() == {"rollout-0": 88.0}
    path.unlink()
    with pytest.raises(TemperatureReadError, match="cannot read"):
        await FileSource(path).read()


# --- the task ---------------------------------------------------------------------------------------

class Temps:
    """A settable temperature source."""

    name = "test"
    unmapped_keys: tuple[str, ...] = ()

    def __init__(self, **temps: float):
        self.temps = dict(temps)
        self.broken = False

    async def read(self) -> dict[str, float]:
        if self.broken:
            raise TemperatureReadError("sensor gone")
        return dict(self.temps)


class Engines:
    """Records pause/continue calls; can refuse them."""

    def __init__(self, *slots: str):
        self.urls = {slot: f"http://{slot}" for slot in slots}
        self.calls: list[tuple[float, str, HeatAction]] = []
        self.refuse: set[str] = set()

    async def call(self, url: str, action: HeatAction) -> None:
        if url in self.refuse:
            raise ConnectionRefusedError(url)
        self.calls.append((asyncio.get_running_loop().time(), url, action))


def metric(name: str, slot: str) -> float:
    return REGISTRY.get_sample_value(name, {"fleet": "heat-test", "slot": slot}) or 0.0


@pytest.mark.looptime
async def test_task_pauses_hot_engine_and_resumes_it_when_cool():
    temps, engines = Temps(**{"r0": 70, "r1": 70}), Engines("r0", "r1")
    pauses_before = metric("rlfleet_heat_guard_pauses_total", "r0")
    paused_s_before = metric("rlfleet_heat_guard_pause_duration_seconds_sum", "r0")
    held: list[str] = []
    guard = HeatGuardTask(SPEC, temps, engines=lambda: engines.urls, call_engine=engines.call,
                          fleet="heat-test", poll_interval_s=5, on_pause=held.append,
                          on_resume=held.remove)
    runner = asyncio.create_task(guard.run())
    await asyncio.sleep(12)  # polls at 0, 5, 10
    temps.temps["r0"] = 86
    await asyncio.sleep(5)  # poll at 15 pauses r0
    assert engines.calls == [(15, "http://r0", HeatAction.PAUSE)]
    assert guard.paused_slots() == {"r0"} and held == ["r0"]
    temps.temps["r0"] = 70  # cools at once, but the pause lasts at least 45 s
    await asyncio.sleep(40)
    assert len(engines.calls) == 1
    await asyncio.sleep(10)  # poll at 60: 45 s held
    assert engines.calls[-1] == (60, "http://r0", HeatAction.RESUME)
    assert guard.paused_slots() == set() and held == []
    assert [(e.slot, e.action, e.reason) for e in guard.events] == [("r0", HeatAction.PAUSE, "hot"),
                                                                     ("r0", HeatAction.RESUME, "cooled")]
    assert guard.events[-1].paused_seconds == 45
    assert metric("rlfleet_heat_guard_pauses_total", "r0") - pauses_before == 1
    assert metric("rlfleet_heat_guard_pause_duration_seconds_sum", "r0") - paused_s_before == 45
    # A step that ran 0-14 s is clean; one that ran 20-30 s overlapped the pause.
    assert not guard.mark_step(1, 0, 14).overlapped_pause
    mark = guard.mark_step(2, 20, 30)
    assert mark.overlapped_pause and mark.paused_slots == ("r0",)
    runner.cancel()


@pytest.mark.looptime
async def test_an_engine_that_stays_hot_is_resumed_after_max_pause_then_paused_again():
    temps, engines = Temps(r0=90), Engines("r0")
    guard = HeatGuardTask(SPEC, temps, engines=lambda: engines.urls, call_engine=engines.call,
                          fleet="heat-test", poll_interval_s=5)
    runner = asyncio.create_task(guard.run())
    await asyncio.sleep(126)
    assert [(t, a) for t, _, a in engines.calls] == [(0, HeatAction.PAUSE), (120, HeatAction.RESUME),
                                                      (125, HeatAction.PAUSE)]
    assert guard.events[1].reason == "max_pause"
    runner.cancel()


@pytest.mark.looptime
async def test_a_refused_pause_is_retried_on_the_next_poll_and_read_errors_do_not_act():
    temps, engines = Temps(r0=90), Engines("r0")
    engines.refuse.add("http://r0")
    errors_before = REGISTRY.get_sample_value("rlfleet_heat_guard_action_errors_total",
                                              {"fleet": "heat-test", "slot": "r0", "action": "pause"}) or 0
    guard = HeatGuardTask(SPEC, temps, engines=lambda: engines.urls, call_engine=engines.call,
                          fleet="heat-test", poll_interval_s=5)
    runner = asyncio.create_task(guard.run())
    await asyncio.sleep(1)
    assert engines.calls == [] and guard.paused_slots() == set()
    engines.refuse.clear()
    await asyncio.sleep(5)
    assert engines.calls == [(5, "http://r0", HeatAction.PAUSE)]
    assert (REGISTRY.get_sample_value("rlfleet_heat_guard_action_errors_total",
                                      {"fleet": "heat-test", "slot": "r0", "action": "pause"})
            or 0) - errors_before == 1
    temps.broken = True  # no readings: stays paused until max_pause
    await asyncio.sleep(120)
    assert engines.calls[-1] == (125, "http://r0", HeatAction.RESUME)
    runner.cancel()


@pytest.mark.looptime
async def test_stopping_the_guard_resumes_what_it_paused_and_gone_slots_are_dropped():
    temps, engines = Temps(r0=90, r1=90), Engines("r0", "r1")
    guard = HeatGuardTask(SPEC, temps, engines=lambda: engines.urls, call_engine=engines.call,
                          fleet="heat-test", poll_interval_s=5)
    runner = asyncio.create_task(guard.run())
    await asyncio.sleep(1)
    assert guard.paused_slots() == {"r0", "r1"}
    del engines.urls["r1"]  # r1 died and left the fleet: not ours to resume
    await asyncio.sleep(5)
    assert guard.paused_slots() == {"r0"}
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert engines.calls[-1][1:] == ("http://r0", HeatAction.RESUME)
    assert [c for c in engines.calls if c[1] == "http://r1"] == [(0, "http://r1", HeatAction.PAUSE)]
    assert guard.events[-1].reason == "shutdown"


@pytest.mark.looptime
async def test_the_hold_spans_the_pause_call_and_a_refused_pause_releases_it():
    temps, engines = Temps(r0=90), Engines("r0")
    holds: list[tuple[float, str, str]] = []
    loop = asyncio.get_running_loop()

    async def call(url: str, action: HeatAction) -> None:
        # The engine call happens while the monitor already holds the engine's probes.
        assert holds and holds[-1][1] == "hold", holds
        await engines.call(url, action)

    guard = HeatGuardTask(SPEC, temps, engines=lambda: engines.urls, call_engine=call, fleet="heat-test",
                          poll_interval_s=5, on_pause=lambda s: holds.append((loop.time(), "hold", s)),
                          on_resume=lambda s: holds.append((loop.time(), "release", s)))
    engines.refuse.add("http://r0")
    runner = asyncio.create_task(guard.run())
    await asyncio.sleep(1)
    assert holds == [(0, "hold", "r0"), (0, "release", "r0")]  # refused: held and released again
    engines.refuse.clear()
    await asyncio.sleep(5)  # poll at 5 pauses
    assert holds[-1] == (5, "hold", "r0") and guard.paused_slots() == {"r0"}
    temps.temps["r0"] = 60
    await asyncio.sleep(45)  # poll at 50: 45 s held and cool
    assert holds[-1] == (50, "release", "r0") and guard.paused_slots() == set()
    runner.cancel()
