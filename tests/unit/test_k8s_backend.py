"""The Kubernetes backend's view of a fleet from pods and the operator's status (no API calls)."""
import asyncio

import pytest

from rlfleet.crds.specs import RecoverySpec
from rlfleet.operator import builders as b
from rlfleet.orchestrator.fleet.backend import DeathCause, EngineState
from rlfleet.orchestrator.fleet.errors import FleetNotReady
from rlfleet.orchestrator.fleet.k8s_backend import KubernetesBackend, fleet_failure, slot_view

FLEET_UID = "fleet-uid"
OWNER = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet", "name": "f", "uid": FLEET_UID,
         "controller": True}


def pod(slot, *, restarts=0, phase="Running", ready=True, exit_code=None, message="", annotations=None, uid=None):
    state = {"terminated": {"exitCode": exit_code, "message": message}} if exit_code is not None \
        else {"running": {}}
    return {"metadata": {"name": b.engine_pod_name("f", slot), "uid": uid or f"u{slot}-{restarts}",
                         "labels": b.engine_labels("f", slot), "ownerReferences": [OWNER],
                         "annotations": {b.ANN_RESTARTS: str(restarts), **(annotations or {})}},
            "status": {"phase": phase, "podIP": f"127.0.0.{20 + slot}",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "engine", "state": state}]}}


def new_backend(replicas: int, min_ready: int = 1) -> KubernetesBackend:
    """A backend of fleet "f", fed by hand (no API client)."""
    return KubernetesBackend(None, namespace="ns", fleet="f", fleet_uid=FLEET_UID, replicas=replicas,
                             min_ready=min_ready, recovery=RecoverySpec())


def test_slot_states_follow_the_pod():
    assert slot_view(0, pod(0), None, port=30000, marked_dead=None, weight_version=None).state is EngineState.ALIVE
    starting = slot_view(0, pod(0, ready=False), None, port=30000, marked_dead=None, weight_version=None)
    assert starting.state is EngineState.STARTING and starting.url == "http://127.0.0.20:30000"
    crashed = slot_view(0, pod(0, phase="Failed", ready=False, exit_code=137), None, port=1, marked_dead=None,
                        weight_version=None)
    assert crashed.state is EngineState.DEAD and crashed.exit_code == 137
    marked = slot_view(0, pod(0, restarts=2), None, port=1, marked_dead=3, weight_version=None)
    assert marked.state is EngineState.DEAD and marked.incarnation == 3
    newer = slot_view(0, pod(0, restarts=3), None, port=1, marked_dead=3, weight_version="7")
    assert newer.state is EngineState.ALIVE and newer.incarnation == 4 and newer.weight_version == "7"
    gone = slot_view(0, None, {"slot": 0, "restarts": 1, "state": "Recreating"}, port=1, marked_dead=None,
                     weight_version=None)
    assert gone.state is EngineState.DEAD
    failed = slot_view(0, pod(0, phase="Failed", exit_code=1), {"slot": 0, "state": "Failed", "restarts": 3},
                       port=1, marked_dead=None, weight_version=None)
    assert failed.state is EngineState.FAILED


def test_a_dead_mark_in_the_fleet_status_counts_for_its_pod_only():
    mark = {"podUID": "u0-0", "dead": "probe_failed", "deadMessage": "3 probes timed out", "weightVersion": "4"}
    dead = slot_view(0, pod(0), None, port=1, marked_dead=None, weight_version=None, mark=mark)
    assert dead.state is EngineState.DEAD and dead.weight_version == "4"
    from rlfleet.kube.marks import engine_marks, mark_of
    marks = engine_marks({"orchestrator": {"engines": {"0": mark}}})
    assert mark_of(pod(0), marks, 0) == mark and mark_of(pod(0, restarts=1), marks, 0) is None
    replacement = slot_view(0, pod(0, restarts=1), None, port=1, marked_dead=None, weight_version=None,
                            mark=mark_of(pod(0, restarts=1), marks, 0))
    assert replacement.state is EngineState.ALIVE and replacement.weight_version is None


def test_operator_failed_condition_becomes_fleet_failed_with_the_log():
    status = {"conditions": [{"type": "Failed", "status": "True", "reason": "EngineCrashLoop",
                              "message": "slot 0 failed ...\nAssertionError: backend"}],
              "engines": [{"slot": 0, "state": "Failed", "lastFailure": {"exitCode": 1,
                                                                          "message": "x\nAssertionError: backend"}}]}
    failure = fleet_failure("f", status)
    assert failure.reason == "EngineCrashLoop" and failure.slot == 0 and failure.exit_code == 1
    assert "AssertionError: backend" in str(failure) and failure.log_tail[-1] == "AssertionError: backend"
    assert fleet_failure("f", {"conditions": [{"type": "Failed", "status": "False"}]}) is None


async def test_a_terminated_container_is_reported_dead_at_once():
    backend = new_backend(2)
    deaths = []
    backend.subscribe(deaths.append)
    await backend._on_pods_listed([pod(0), pod(1)])
    assert [e.state for e in backend.engines()] == [EngineState.ALIVE, EngineState.ALIVE]
    await backend._on_pod_event("MODIFIED", pod(1, phase="Failed", ready=False, exit_code=137, message="killed"))
    assert [(d.slot, d.incarnation, d.cause) for d in deaths] == [(1, 1, DeathCause.EXITED)]
    assert "exit code 137" in deaths[0].reason
    await backend._on_pod_event("MODIFIED", pod(1, phase="Failed", ready=False, exit_code=137))
    assert len(deaths) == 1  # reported once per incarnation
    await backend._on_pod_event("DELETED", pod(1, phase="Failed", ready=False, exit_code=137))
    assert backend.engines()[1].state is EngineState.DEAD and len(deaths) == 1
    await backend._on_pod_event("ADDED", pod(1, restarts=1, ready=False, uid="new"))
    assert backend.engines()[1].state is EngineState.STARTING and backend.engines()[1].incarnation == 2


async def test_wait_all_alive_returns_when_the_replacement_is_ready():
    backend = new_backend(1)
    await backend._on_pods_listed([pod(0, restarts=1, ready=False)])

    async def becomes_ready():
        await asyncio.sleep(0.05)
        await backend._on_pod_event("MODIFIED", pod(0, restarts=1))

    task = asyncio.create_task(becomes_ready())
    alive = await backend.wait_all_alive(timeout=5)
    await task
    assert [(e.slot, e.incarnation) for e in alive] == [(0, 2)]


async def test_wait_all_alive_is_bounded_and_says_why():
    backend = new_backend(1)
    await backend._on_pods_listed([pod(0, ready=False)])
    with pytest.raises(FleetNotReady, match="0 of 1 engines alive.*slot 0: starting"):
        await backend.wait_all_alive(timeout=0.1)


async def test_orchestrator_may_not_write_the_operators_status_fields():
    from rlfleet.orchestrator.fleet.k8s_backend import report_run_progress

    with pytest.raises(ValueError, match="phase"):
        await report_run_progress(None, "ns", "r", step=3, phase="Succeeded")


async def test_recover_reports_a_slot_recreated_since_its_weights_were_loaded_once():
    """A crash seen by the pod watch and already replaced by the operator still counts as recovered at the
    next sync (its new pod has no weights yet), and only at that sync."""
    backend = new_backend(2)
    await backend._on_pods_listed([pod(0), pod(1)])
    assert await backend.recover() == []  # the fleet's own start is not a recovery
    await backend.wait_all_alive(timeout=1)  # bring-up: weights "0" go on incarnations 1, 1
    assert await backend.recover() == []

    await backend._on_pod_event("MODIFIED", pod(1, phase="Failed", ready=False, exit_code=137))
    assert await backend.recover() == [1]  # dead: the operator is recreating it
    await backend._on_pod_event("DELETED", pod(1, phase="Failed", ready=False, exit_code=137))
    await backend._on_pod_event("ADDED", pod(1, restarts=1, ready=False, uid="new"))
    assert await backend.recover() == [1]  # starting
    await backend._on_pod_event("MODIFIED", pod(1, restarts=1, uid="new"))
    assert await backend.recover() == [1]  # ready before the sync looked: still needs the weights
    alive = await backend.wait_all_alive(timeout=1)  # the sync loads its weights on both
    assert [(e.slot, e.incarnation) for e in alive] == [(0, 1), (1, 2)]
    assert await backend.recover() == []  # the next sync has nothing to recover


def test_the_router_in_use_is_kept_while_ready_and_a_ready_replacement_is_taken_when_it_goes():
    from rlfleet.orchestrator.fleet.k8s_backend import pick_router

    def router(ip, *, ready=True, deleting=False):
        meta = {"name": f"r-{ip}", "uid": ip, "labels": b.router_labels("f")}
        if deleting:
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return {"metadata": meta, "status": {"phase": "Running", "podIP": ip,
                                             "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    old, new = "http://10.0.0.1:30000", "http://10.0.0.2:30000"
    assert pick_router([router("10.0.0.2"), router("10.0.0.1")], 30000, prefer=old).url == old  # type: ignore[union-attr]
    assert pick_router([router("10.0.0.1", deleting=True), router("10.0.0.2")], 30000, prefer=old).url == new  # type: ignore[union-attr]
    assert pick_router([router("10.0.0.1", ready=False), router("10.0.0.2", ready=False)], 30000) is None


def test_a_router_restarted_in_its_pod_is_told_from_one_moved_and_from_one_unchanged():
    from rlfleet.orchestrator.fleet.k8s_backend import pick_router, router_change

    def router(ip, uid, restarts, sidecar_restarts=0):
        return {"metadata": {"name": f"r-{uid}", "uid": uid, "labels": b.router_labels("f")},
                "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}],
                           "containerStatuses": [{"name": "router", "restartCount": restarts},
                                                 {"name": "sidecar", "restartCount": sidecar_restarts}]}}

    url = "http://10.0.0.1:30000"
    first = pick_router([router("10.0.0.1", "a", 0)], 30000, prefer=url)
    assert first is not None and first.url == url
    assert router_change(url, None, first) is None  # the first look: nothing to compare with yet
    assert router_change(url, first.incarnation, first) is None
    sidecar = pick_router([router("10.0.0.1", "a", 0, sidecar_restarts=3)], 30000, prefer=url)
    assert sidecar is not None and router_change(url, first.incarnation, sidecar) is None  # not the router's
    again = pick_router([router("10.0.0.1", "a", 1)], 30000, prefer=url)  # its container restarted
    assert again is not None and router_change(url, first.incarnation, again) == "restarted"
    same_ip = pick_router([router("10.0.0.1", "b", 0)], 30000, prefer=url)  # a new pod at the same address
    assert same_ip is not None and router_change(url, first.incarnation, same_ip) == "restarted"
    moved = pick_router([router("10.0.0.2", "c", 0)], 30000, prefer=url)
    assert moved is not None and router_change(url, first.incarnation, moved) == "moved"


def fleet_object(replicas, min_ready=1):
    return {"metadata": {"name": "f", "uid": FLEET_UID}, "spec": {"replicas": replicas, "minReadyEngines": min_ready},
            "status": {}}


async def test_a_scaled_up_fleet_loads_its_new_slots_once_ready_without_holding_a_sync_up():
    backend = new_backend(1)
    resizes, deaths = [], []
    backend.subscribe_resize(resizes.append)
    backend.subscribe(deaths.append)
    await backend._on_fleets_listed([fleet_object(1)])
    await backend._on_pods_listed([pod(0)])
    await backend.wait_all_alive(timeout=1)
    assert resizes == []  # the spec it started with

    await backend._on_fleet_event("MODIFIED", fleet_object(3))
    (event,) = resizes
    assert (event.replicas_before, event.replicas, event.min_ready, event.retired) == (1, 3, 1, ())
    assert backend.replicas == 3
    # Slots 1 and 2 have no pod yet: starting, not dead, not a recovery, and no sync waits for them.
    assert [e.state for e in backend.engines()] == [EngineState.ALIVE, EngineState.STARTING, EngineState.STARTING]
    assert await backend.recover() == []
    alive = await asyncio.wait_for(backend.wait_all_alive(timeout=60), 1)
    assert [e.slot for e in alive] == [0]

    # Once Ready, the next sync loads them (and from then on waits for them as for any engine).
    await backend._on_pod_event("ADDED", pod(1))
    await backend._on_pod_event("ADDED", pod(2, ready=False))
    alive = await asyncio.wait_for(backend.wait_all_alive(timeout=60), 1)
    assert [(e.slot, e.incarnation) for e in alive] == [(0, 1), (1, 1)]
    await backend._on_pod_event("MODIFIED", pod(2))
    assert [e.slot for e in await backend.wait_all_alive(timeout=1)] == [0, 1, 2]
    await backend._on_pod_event("MODIFIED", pod(1, ready=False))  # a slot that served is waited for
    try:
        await backend.wait_all_alive(timeout=0.1)
    except FleetNotReady:
        raise AssertionError("two of three serve: minReadyEngines 1 is met") from None
    assert deaths == [] and await backend.recover() == []


async def test_a_scale_up_that_minready_needs_is_waited_for():
    backend = new_backend(1)
    await backend._on_fleets_listed([fleet_object(1)])
    await backend._on_pods_listed([pod(0)])
    await backend._on_fleet_event("MODIFIED", fleet_object(3, min_ready=2))
    assert backend.min_ready == 2
    with pytest.raises(FleetNotReady, match="1 of 3 engines alive.*minReadyEngines=2"):
        await backend.wait_all_alive(timeout=0.1)

    async def comes_up():
        await asyncio.sleep(0.05)
        await backend._on_pod_event("ADDED", pod(2))
    task = asyncio.create_task(comes_up())
    alive = await backend.wait_all_alive(timeout=5)
    await task
    assert [e.slot for e in alive] == [0, 2]


async def test_a_slot_scaled_away_leaves_without_a_death_and_comes_back_afresh():
    backend = new_backend(2)
    resizes, deaths = [], []
    backend.subscribe_resize(resizes.append)
    backend.subscribe(deaths.append)
    await backend._on_fleets_listed([fleet_object(2)])
    await backend._on_pods_listed([pod(0), pod(1)])
    await backend.wait_all_alive(timeout=1)

    await backend._on_fleet_event("MODIFIED", fleet_object(1))
    (event,) = resizes
    assert (event.replicas_before, event.replicas) == (2, 1)
    assert [(e.slot, e.incarnation, e.url) for e in event.retired] == [(1, 1, "http://127.0.0.21:30000")]
    assert [e.slot for e in backend.engines()] == [0]
    # The operator ends the pod: its end is no death, and a late dead mark for it changes nothing.
    await backend._on_pod_event("MODIFIED", pod(1, phase="Failed", ready=False, exit_code=143))
    assert deaths == []
    assert await backend.mark_dead(1, "probe failed", incarnation=1) is False

    # Scaled up again before the old pod is gone: the old pod never speaks for the slot again, and the
    # slot's new pod counts its incarnations from 1 again, watched as any.
    await backend._on_fleet_event("MODIFIED", fleet_object(2))
    assert backend.engines()[1].state is EngineState.STARTING
    await backend._on_pod_event("DELETED", pod(1, phase="Failed", ready=False, exit_code=143))
    assert deaths == [] and backend.engines()[1].state is EngineState.STARTING
    await backend._on_pod_event("ADDED", pod(1, uid="again"))
    assert backend.engines()[1].state is EngineState.ALIVE and backend.engines()[1].incarnation == 1
    await backend._on_pod_event("MODIFIED", pod(1, uid="again", phase="Failed", ready=False, exit_code=137))
    assert [(d.slot, d.incarnation, d.cause) for d in deaths] == [(1, 1, DeathCause.EXITED)]


async def test_engine_state_series_follow_the_pods_and_a_slot_scaled_away_leaves_none():
    from prometheus_client import REGISTRY

    from rlfleet.observability import metrics
    from rlfleet.orchestrator.fleet.backend import ENGINE_STATES

    def state(slot):
        values = {s: REGISTRY.get_sample_value("rlfleet_engine_state", {"fleet": "f", "slot": str(slot), "state": s})
                  for s in ENGINE_STATES}
        return [s for s, v in values.items() if v == 1] or None

    backend = new_backend(2)
    await backend._on_pods_listed([pod(0), pod(1, ready=False)])
    assert (state(0), state(1)) == (["alive"], ["starting"])
    await backend._on_pod_event("MODIFIED", pod(1, phase="Failed", ready=False, exit_code=1))
    assert state(1) == ["dead"]
    metrics.ENGINE_WEIGHT_VERSION.labels(fleet="f", slot="1").set(3)
    metrics.forget_engine_slot("f", 1, ENGINE_STATES)  # what the runtime does for a slot scaled away
    assert state(1) is None
    assert REGISTRY.get_sample_value("rlfleet_engine_weight_version", {"fleet": "f", "slot": "1"}) is None
    assert REGISTRY.get_sample_value("rlfleet_engine_restarts", {"fleet": "f", "slot": "1"}) is None


def test_the_fleets_restart_budget_is_exported_for_the_restart_alerts():
    """The operator spends the budget, but only the trainer exports metrics: without these series the
    restart-budget alerts compare the slots' restarts with nothing and never fire."""
    from prometheus_client import REGISTRY

    KubernetesBackend(None, namespace="ns", fleet="f-budget", fleet_uid=FLEET_UID, replicas=2, min_ready=1,
                      recovery=RecoverySpec(max_restarts_per_engine=3, max_restarts_per_run=7))
    budget = {scope: REGISTRY.get_sample_value("rlfleet_engine_restart_budget", {"fleet": "f-budget", "scope": scope})
              for scope in ("engine", "run")}
    assert budget == {"engine": 3, "run": 7}


class UnansweredPatches:
    """A client whose status writes fail as an API server out of reach makes them fail (no API calls)."""

    def __init__(self) -> None:
        self.tries = 0

    async def merge_patch(self, *args, **kwargs) -> None:
        self.tries += 1
        raise OSError("connection refused")


@pytest.mark.looptime
async def test_a_dead_mark_written_again_stops_quietly_once_its_slot_is_scaled_away():
    kube = UnansweredPatches()
    backend = KubernetesBackend(kube, namespace="ns", fleet="f", fleet_uid=FLEET_UID, replicas=2, min_ready=1,
                                recovery=RecoverySpec())
    await backend._on_fleets_listed([fleet_object(2)])
    await backend._on_pods_listed([pod(0), pod(1)])
    await backend.wait_all_alive(timeout=1)
    assert await backend.mark_dead(1, "probe failed") is True  # dead here, though the write failed
    (retry,) = backend._mark_retries
    await asyncio.sleep(1.5)
    assert kube.tries == 2 and not retry.done()  # written again after 1 s, and again later
    await backend._on_fleet_event("MODIFIED", fleet_object(1))  # slot 1 is scaled away
    await asyncio.wait([retry], timeout=10)
    assert retry.done() and retry.exception() is None and kube.tries == 2
    await backend.stop()
