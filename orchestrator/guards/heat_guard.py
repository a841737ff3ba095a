"""The heat guard: pause generation on an engine whose GPU runs hot, resume when it cools.

Per engine: at or above `pauseAtC` pause generation (`/pause_generation {"mode": "retract"}`, which
keeps in-flight requests and makes new ones wait instead of failing); resume (`/continue_generation`)
at or below `resumeAtC` once the pause has lasted `minPauseSeconds`, or after `maxPauseSeconds`
whatever the temperature, so a GPU that never cools still makes progress between pauses.

`EngineHeat` is the pure per-engine decision; `PauseLedger` remembers pause intervals so steps that
overlapped one can be marked; `HeatGuardTask` reads a temperature source and applies decisions.
`heat_guard_for` builds the task for a started FleetRuntime (its engines, session and monitor) and
where its engines run (`LocalEngines`: processes on this machine's GPUs; `EnginePods`: pods);
`check_heat_guard` refuses, before a run starts, a source that could not read those engines' GPUs.
Temperature sources live in heat_sources.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from rlfleet.crds.conventions import engine_pod_name
from rlfleet.crds.specs import HeatGuardSpec
from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet.backend import EngineState
from rlfleet.orchestrator.fleet.runtime import FleetRuntime
from rlfleet.orchestrator.guards.heat_sources import (
    CUDA_VISIBLE_DEVICES,
    PROMETHEUS_NAMESPACE_LABELS,
    PROMETHEUS_POD_LABELS,
    DcgmKeys,
    HeatGuardSetupError,
    SlotsByGpu,
    SlotsByPod,
    TemperatureSource,
    build_source,
    engine_temperature_query,
    parse_visible_devices,
    visible_gpu_entries,
)
from rlfleet.sglang.engine import EngineClient, PauseMode

log = logging.getLogger(__name__)

PAUSE_MODE: PauseMode = "retract"  # keeps requests (abort would fail them; in_place leaves a stale cache)


class HeatAction(enum.StrEnum):
    PAUSE = "pause"
    RESUME = "resume"


@dataclass(frozen=True)
class HeatDecision:
    action: HeatAction
    reason: str  # hot | cooled | max_pause | shutdown


class EngineHeat:
    """One engine's pause state. `decide()` proposes; `applied()` commits once the engine obeyed."""

    def __init__(self, spec: HeatGuardSpec):
        self.spec = spec
        self.paused_since: float | None = None

    @property
    def paused(self) -> bool:
        return self.paused_since is not None

    def decide(self, temp_c: float | None, now: float) -> HeatDecision | None:
        """What to do given the latest reading (None: no reading this round)."""
        if self.paused_since is None:
            if temp_c is not None and temp_c >= self.spec.pause_at_c:
                return HeatDecision(HeatAction.PAUSE, "hot")
            return None
        held = now - self.paused_since
        if held >= self.spec.max_pause_seconds:
            return HeatDecision(HeatAction.RESUME, "max_pause")
        if temp_c is not None and temp_c <= self.spec.resume_at_c and held >= self.spec.min_pause_seconds:
            return HeatDecision(HeatAction.RESUME, "cooled")
        return None

    def applied(self, action: HeatAction, now: float) -> float:
        """Commit an action the engine accepted; returns the pause length for a resume (else 0)."""
        if action is HeatAction.PAUSE:
            self.paused_since = now
            return 0.0
        held = now - self.paused_since if self.paused_since is not None else 0.0
        self.paused_since = None
        return held


@dataclass
class PauseInterval:
    slot: str
    start: float
    end: float | None = None  # None while the pause lasts


class PauseLedger:
    """Pause intervals on one clock, so a step's [start, end] can be checked against them."""

    def __init__(self, keep: int = 10_000):
        self._intervals: deque[PauseInterval] = deque(maxlen=keep)
        self._open: dict[str, PauseInterval] = {}

    def start(self, slot: str, at: float) -> None:
        if slot in self._open:
            return
        interval = PauseInterval(slot, at)
        self._open[slot] = interval
        self._intervals.append(interval)

    def end(self, slot: str, at: float) -> None:
        interval = self._open.pop(slot, None)
        if interval is not None:
            interval.end = at

    def overlapping(self, start: float, end: float) -> set[str]:
        """Slots that were paused at any moment of [start, end]."""
        return {i.slot for i in self._intervals if i.start <= end and (i.end is None or i.end >= start)}


@dataclass(frozen=True)
class HeatEvent:
    """One pause or resume, for the run's event log."""

    at: float  # wall-clock epoch seconds
    slot: str
    action: HeatAction
    reason: str
    temp_c: float | None
    paused_seconds: float = 0.0


@dataclass(frozen=True)
class StepMark:
    step: int
    seconds: float
    overlapped_pause: bool
    paused_slots: tuple[str, ...] = field(default_factory=tuple)


# Applies an action to one engine URL; raises on failure. The default posts to the engine.
EngineCall = Callable[[str, HeatAction], Awaitable[None]]


@dataclass(frozen=True)
class Unmatched:
    """A read that found temperatures, none of them an engine's: the keys it saw, the slots expected."""

    seen: tuple[str, ...]
    expected: tuple[str, ...]


def unmatched_readings(seen: Iterable[str], expected: Iterable[str]) -> Unmatched | None:
    """Unmatched when the read saw keys but none of the expected slots (else None: readings match, or
    there was nothing to match)."""
    seen_keys, expected_slots = set(seen), set(expected)
    if not seen_keys or not expected_slots or seen_keys & expected_slots:
        return None
    return Unmatched(tuple(sorted(seen_keys)), tuple(sorted(expected_slots)))


def listed(keys: Sequence[str], most: int = 12) -> str:
    """Keys for a log line; a DCGM exporter may report many pods that are not ours."""
    shown = ", ".join(keys[:most])
    return shown if len(keys) <= most else f"{shown} and {len(keys) - most} more"


class HeatGuardTask:
    """Polls the temperature source every `pollIntervalSeconds` and pauses/resumes engines.

    `engines()` returns the current slot -> engine URL map (dead or replaced slots drop out).
    `on_pause` / `on_resume` let the health monitor hold its probes of an engine the guard pauses (a
    paused engine holds /health_generate, then answers 503): on_pause runs before the pause call (and
    on_resume right after it if that call fails), on_resume after the engine accepted the resume.
    Stopping the task (cancel) resumes every engine it holds paused, so no run stays paused.
    """

    def __init__(self, spec: HeatGuardSpec, source: TemperatureSource, *,
                 engines: Callable[[], Mapping[str, str]], call_engine: EngineCall,
                 fleet: str = "rollout", poll_interval_s: float | None = None,
                 on_pause: Callable[[str], None] | None = None, on_resume: Callable[[str], None] | None = None,
                 on_event: Callable[[HeatEvent], None] | None = None, keep_events: int = 10_000):
        # Settings that would flap or never resume (resumeAtC >= pauseAtC, minPause > maxPause) are
        # rejected by HeatGuardSpec's own rules.
        self.spec = spec
        self.source = source
        self.fleet = fleet
        self.poll_interval_s = spec.poll_interval_seconds if poll_interval_s is None else poll_interval_s
        self._engines = engines
        self._call_engine = call_engine
        self._on_pause = on_pause
        self._on_resume = on_resume
        self._on_event = on_event
        self.states: dict[str, EngineHeat] = {}
        self.ledger = PauseLedger()
        self.events: deque[HeatEvent] = deque(maxlen=keep_events)
        self._urls: dict[str, str] = {}
        self._unmatched_warned: Unmatched | None = None  # warned once, until what is seen or expected changes

    def paused_slots(self) -> set[str]:
        return {slot for slot, state in self.states.items() if state.paused}

    def mark_step(self, step: int, started: float, ended: float) -> StepMark:
        """Mark a training step (times on the loop clock) that overlapped any pause."""
        slots = tuple(sorted(self.ledger.overlapping(started, ended)))
        if slots:
            metrics.STEPS_OVERLAPPING_PAUSE.labels(fleet=self.fleet).inc()
        return StepMark(step=step, seconds=ended - started, overlapped_pause=bool(slots), paused_slots=slots)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            next_poll = loop.time()
            while True:
                await self.poll_once()
                next_poll += self.poll_interval_s
                await asyncio.sleep(max(0.0, next_poll - loop.time()))
        finally:
            await asyncio.shield(self._resume_all())

    async def poll_once(self) -> None:
        loop = asyncio.get_running_loop()
        seen: tuple[str, ...] = ()  # every key the read found, an engine's or not
        try:
            temps = await self.source.read()
        except HeatGuardSetupError:
            raise  # the source can never read the engines' GPUs: the run fails with the reason
        except Exception as exc:
            metrics.HEAT_GUARD_READ_ERRORS.labels(fleet=self.fleet, source=self.source.name).inc()
            log.warning("heat guard: cannot read temperatures from %s: %s", self.source.name, exc)
            temps = {}
        else:
            seen = (*temps, *self.source.unmapped_keys)
        engines = dict(self._engines())
        self._forget_gone(set(engines), loop.time())
        self._urls = engines
        self._warn_if_unmatched(seen, engines)
        for slot, temp in temps.items():
            if slot in engines:
                metrics.GPU_TEMPERATURE.labels(fleet=self.fleet, slot=slot).set(temp)
        await asyncio.gather(*(self._step_engine(slot, url, temps.get(slot), loop.time())
                               for slot, url in engines.items()))

    def _warn_if_unmatched(self, seen: Iterable[str], engines: Iterable[str]) -> None:
        """A source whose keys are no engine's never pauses anything: say so, once per mismatch."""
        unmatched = unmatched_readings(seen, engines)
        if unmatched is None or unmatched == self._unmatched_warned:
            return
        self._unmatched_warned = unmatched
        log.warning("heat guard: %s read temperatures for %s, but none for the engines %s: none of them can be "
                    "paused until the source names them", self.source.name, listed(unmatched.seen),
                    listed(unmatched.expected))

    async def _step_engine(self, slot: str, url: str, temp: float | None, now: float) -> None:
        state = self.states.setdefault(slot, EngineHeat(self.spec))
        decision = state.decide(temp, now)
        if decision is not None:
            await self._apply(slot, url, state, decision, temp)

    async def _apply(self, slot: str, url: str, state: EngineHeat, decision: HeatDecision,
                     temp: float | None) -> bool:
        pausing = decision.action is HeatAction.PAUSE
        if pausing and self._on_pause:
            # Before the engine stops generating: its health probes must not see the pause.
            self._on_pause(slot)
        try:
            await self._call_engine(url, decision.action)
        except Exception as exc:
            if pausing and self._on_resume:
                self._on_resume(slot)  # not paused after all
            metrics.HEAT_GUARD_ACTION_ERRORS.labels(fleet=self.fleet, slot=slot, action=decision.action.value).inc()
            log.warning("heat guard: %s on %s (%s) failed: %s", decision.action.value, slot, url, exc)
            return False
        now = asyncio.get_running_loop().time()
        held = state.applied(decision.action, now)
        labels = {"fleet": self.fleet, "slot": slot}
        if pausing:
            self.ledger.start(slot, now)
            metrics.HEAT_GUARD_PAUSES.labels(**labels).inc()
            metrics.HEAT_GUARD_PAUSED.labels(**labels).set(1)
        else:
            self.ledger.end(slot, now)
            metrics.HEAT_GUARD_PAUSE_DURATION.labels(**labels).observe(held)
            metrics.HEAT_GUARD_PAUSED.labels(**labels).set(0)
            if self._on_resume:
                self._on_resume(slot)  # after the engine generates again
        event = HeatEvent(at=time.time(), slot=slot, action=decision.action, reason=decision.reason,
                          temp_c=temp, paused_seconds=held)
        self.events.append(event)
        log.warning("heat guard: %s %s (%s, %s C%s)", decision.action.value, slot, decision.reason,
                    "?" if temp is None else f"{temp:.0f}",
                    f", paused {held:.0f} s" if decision.action is HeatAction.RESUME else "")
        if self._on_event:
            self._on_event(event)
        return True

    def _forget_gone(self, current: set[str], now: float) -> None:
        """A slot that left the fleet (dead, replaced) is no longer ours to resume."""
        for slot in set(self.states) - current:
            if self.states.pop(slot).paused:
                self.ledger.end(slot, now)
                metrics.HEAT_GUARD_PAUSED.labels(fleet=self.fleet, slot=slot).set(0)

    async def _resume_all(self) -> None:
        """Resume every engine still paused (on stop); bounded by the engine calls' own timeouts."""
        paused = [(slot, state) for slot, state in self.states.items() if state.paused and slot in self._urls]
        decision = HeatDecision(HeatAction.RESUME, "shutdown")
        with contextlib.suppress(Exception):
            await asyncio.gather(*(self._apply(slot, self._urls[slot], state, decision, None)
                                   for slot, state in paused))


async def post_engine_action(session: aiohttp.ClientSession, url: str, action: HeatAction, *,
                             timeout_s: float = 10.0) -> None:
    """The engine side of an action: /pause_generation {"mode": "retract"} or /continue_generation."""
    client = EngineClient(session, url)
    if action is HeatAction.PAUSE:
        await client.pause_generation(PAUSE_MODE, timeout_s=timeout_s)
    else:
        await client.continue_generation(timeout_s=timeout_s)


def heat_slot(fleet: str, slot: int) -> str:
    """The heat guard's name of a fleet's slot, as temperature files and metrics spell it: `<fleet>-<slot>`."""
    return f"{fleet}-{slot}"


@dataclass(frozen=True)
class EnginePodSlots:
    """A fleet's engine pod `<fleet>-engine-<n>` -> its heat-guard slot `<fleet>-<n>`, whatever the number of
    slots (a run's rollout fleet may be scaled while the guard runs)."""

    fleet: str

    def get(self, pod: str, /) -> str | None:
        slot = slot_of_name(pod, engine_pod_name(self.fleet, 0).removesuffix("0"))
        return None if slot is None else heat_slot(self.fleet, slot)


def slot_of_name(name: str, prefix: str) -> int | None:
    """n of `<prefix><n>` (a slot number as the project writes it: no sign, no leading zero), else None."""
    rest = name.removeprefix(prefix)
    if rest == name or not rest.isascii() or not rest.isdigit() or (rest != "0" and rest.startswith("0")):
        return None
    return int(rest)


def slot_by_gpu_index(fleet: str, replicas: int, *, gpus_per_engine: int = 1,
                      gpu_bases: Sequence[int] = ()) -> dict[int, str]:
    """The GPU the heat guard reads for each slot (its first), by index: `gpu_bases` where the run placed
    the engines (a local run), else slot n on GPUs n*gpusPerEngine.. ."""
    return {gpu_bases[slot] if gpu_bases else slot * max(1, gpus_per_engine): heat_slot(fleet, slot)
            for slot in range(replicas)}


@dataclass(frozen=True)
class LocalEngines:
    """The engines are processes on this machine: slot n's first GPU is `gpu_bases[n]`, counted among the
    GPUs CUDA_VISIBLE_DEVICES shows (`visible_devices`: its entries; None when unset). No bases: the engines
    run on no GPU."""

    gpu_bases: tuple[int, ...] = ()
    visible_devices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class EnginePods:
    """The engines are the fleet's pods (`<fleet>-engine-<slot>`) in `namespace`, on GPU nodes of their own."""

    namespace: str


EnginePlacement = LocalEngines | EnginePods


def engine_visible_devices(inherited: Mapping[str, str], engine_env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The entries of the CUDA_VISIBLE_DEVICES local engines start with (their own env's, else the one they
    inherit): what their GPU indices count in."""
    return parse_visible_devices(engine_env.get(CUDA_VISIBLE_DEVICES, inherited.get(CUDA_VISIBLE_DEVICES)))


def check_heat_guard(spec: HeatGuardSpec, placement: EnginePlacement) -> None:
    """Refuse (HeatGuardSetupError) an enabled guard whose source could not read the engines' GPUs there."""
    if not spec.enabled:
        return
    kind = spec.source.type
    if kind == "prometheus" and not isinstance(placement, EnginePods):
        raise HeatGuardSetupError(
            "spec.heatGuard.source.type: prometheus reads the DCGM exporters of a cluster's nodes by the engine "
            "pods' names; a local run's engines are processes on this machine: use nvml or dcgm")
    if isinstance(placement, EnginePods):
        if kind == "nvml":
            raise HeatGuardSetupError(
                "spec.heatGuard.source.type: nvml reads the GPUs of the node the orchestrator runs on (the trainer "
                "pod's), not the engine pods'; on Kubernetes use prometheus (the Prometheus that scrapes every "
                "node's DCGM exporter), dcgm (one node's DCGM exporter, with its Kubernetes pod mapping) or file")
        return
    if kind in ("nvml", "dcgm") and not placement.gpu_bases:
        raise HeatGuardSetupError(
            f"spec.heatGuard.source.type: {kind} reads the engines' GPUs, but the rollout engines run on no GPU "
            f"(spec.rollout.engine.device is not cuda); use file")
    if kind in ("nvml", "dcgm"):  # every slot's GPU must be one CUDA_VISIBLE_DEVICES names
        visible_gpu_entries({base: f"slot {slot}" for slot, base in enumerate(placement.gpu_bases)},
                            placement.visible_devices)


def gpu_by_slot(fleet: str, replicas: int, placement: LocalEngines) -> dict[str, str]:
    """Each slot's first GPU as NVML and DCGM number GPUs (`visible_gpu_entries`)."""
    return visible_gpu_entries(slot_by_gpu_index(fleet, replicas, gpu_bases=placement.gpu_bases),
                               placement.visible_devices)


def dcgm_keys(fleet: str, replicas: int, placement: EnginePlacement, *, prometheus: bool = False) -> DcgmKeys:
    """Which DCGM samples are which slot's: by the engine pod's name on Kubernetes (as a Prometheus stores
    the exporter's labels when `prometheus`), else by GPU."""
    if isinstance(placement, EnginePods):
        slots = EnginePodSlots(fleet)
        if prometheus:
            return SlotsByPod(slots, namespace=placement.namespace, pod_labels=PROMETHEUS_POD_LABELS,
                              namespace_labels=PROMETHEUS_NAMESPACE_LABELS)
        return SlotsByPod(slots, namespace=placement.namespace)
    return SlotsByGpu(gpu_by_slot(fleet, replicas, placement))


def engine_pods_pattern(fleet: str) -> str:
    """A regular expression of the fleet's engine pod names (`<fleet>-engine-<slot>`). Fleet names are DNS
    labels: nothing in them means anything to a regular expression outside brackets (`-` included)."""
    prefix = engine_pod_name(fleet, 0).removesuffix("0")
    if not re.fullmatch(r"[a-z0-9-]+", prefix):
        raise ValueError(f"fleet name {fleet!r} is not a DNS label")
    return prefix + "[0-9]+"


def build_heat_source(spec: HeatGuardSpec, fleet: str, replicas: int, placement: EnginePlacement, *,
                      session: aiohttp.ClientSession | None = None) -> TemperatureSource:
    """The temperature source of an enabled guard, keyed by `heat_slot` names wherever the engines run."""
    check_heat_guard(spec, placement)
    kind = spec.source.type
    keys = dcgm_keys(fleet, replicas, placement, prometheus=kind == "prometheus") \
        if kind in ("dcgm", "prometheus") else None
    gpus = gpu_by_slot(fleet, replicas, placement) if kind == "nvml" and isinstance(placement, LocalEngines) else None
    query = engine_temperature_query(engine_pods_pattern(fleet)) if kind == "prometheus" else None
    source = build_source(spec.source, session=session, dcgm_keys=keys, gpu_by_slot=gpus, query=query)
    if source is None:
        raise ValueError("an enabled heat guard needs a temperature source other than none")
    return source


def heat_guard_for(runtime: FleetRuntime, spec: HeatGuardSpec, *, placement: EnginePlacement = LocalEngines(),
                   on_event: Callable[[HeatEvent], None] | None = None) -> HeatGuardTask:
    """A heat guard for a started fleet's alive engines (run it as a task; cancelling it resumes what it
    paused). While it holds an engine paused, the fleet's monitor holds that engine's probes.
    `placement`: where the engines run, so the source reads their GPUs (HeatGuardSetupError if it cannot)."""
    assert runtime.session is not None and runtime.monitor is not None, "FleetRuntime not started"
    backend, session, monitor = runtime.backend, runtime.session, runtime.monitor
    prefix = heat_slot(runtime.fleet, 0).removesuffix("0")

    def slot_number(name: str) -> int:
        slot = slot_of_name(name, prefix)
        assert slot is not None, f"{name} is not a heat-guard slot of fleet {runtime.fleet}"
        return slot

    source = build_heat_source(spec, runtime.fleet, backend.replicas, placement, session=session)

    def engines() -> dict[str, str]:
        return {heat_slot(runtime.fleet, e.slot): e.url for e in backend.engines()
                if e.state is EngineState.ALIVE and e.url}

    return HeatGuardTask(spec, source, engines=engines, call_engine=functools.partial(post_engine_action, session),
                         fleet=runtime.fleet, on_pause=lambda name: monitor.hold(slot_number(name), "heat guard pause"),
                         on_resume=lambda name: monitor.release(slot_number(name)), on_event=on_event)
