"""Which engine pods a fleet of no run's router routes to (pure)."""
from rlfleet.orchestrator.fleet.engine_follower import routable_engine_urls

FLEET_UID = "fleet-uid"


def pod(name: str, ip: str | None = "10.0.0.1", *, phase: str = "Running", ready: bool = True,
        owner: str | None = FLEET_UID, deleting: bool = False) -> dict:
    meta: dict = {"name": name, "uid": f"{name}-uid", "labels": {}}
    if owner:
        meta["ownerReferences"] = [{"kind": "RolloutFleet", "name": "f", "uid": owner, "controller": True}]
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T05:00:00Z"
    status: dict = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_only_ready_running_pods_the_fleet_controls_are_routed_to():
    pods = [
        pod("f-engine-0", "10.0.0.1"),
        pod("f-engine-1", "10.0.0.2", ready=False),  # starting, or its readiness probe fails
        pod("f-engine-2", "10.0.0.3", phase="Failed", ready=True),  # crashed; Ready not yet cleared
        pod("f-engine-3", "10.0.0.4", deleting=True),  # being replaced: drained before it goes
        pod("f-engine-4", None),  # no IP yet
        pod("f-engine-5", "10.0.0.6", owner="someone-else"),  # carries the labels, not the fleet's
        pod("f-engine-6", "10.0.0.7", owner=None),
        pod("f-engine-7", "10.0.0.8"),
    ]
    assert routable_engine_urls(pods, fleet_uid=FLEET_UID, port=30000) == [
        "http://10.0.0.1:30000", "http://10.0.0.8:30000"]


def test_a_new_pod_on_a_reused_ip_is_routed_to_and_nothing_else_is():
    old = pod("f-engine-0", "10.0.0.1", phase="Failed", ready=False)
    new = pod("f-engine-0b", "10.0.0.1")
    assert routable_engine_urls([old, new], fleet_uid=FLEET_UID, port=8000) == ["http://10.0.0.1:8000"]
    assert routable_engine_urls([old], fleet_uid=FLEET_UID, port=8000) == []


def test_the_follower_is_ready_while_its_reconciles_succeed_and_says_why_not():
    from rlfleet.orchestrator.fleet.engine_follower import follower_ready

    assert follower_ready(100.0, 110.0, interval_s=5, problem=None)[0] is True
    assert follower_ready(100.0, 115.0, interval_s=5, problem=None)[0] is True  # 3 intervals, at least 15 s
    ok, why = follower_ready(100.0, 116.0, interval_s=5, problem="watching the engine pods: 403 Forbidden")
    assert not ok and why == ("the router's workers were reconciled not for 16 s: watching the engine pods: "
                              "403 Forbidden")
    ok, why = follower_ready(None, 3.0, interval_s=5, problem=None)
    assert not ok and why == "the router's workers were reconciled never: no pod list yet"
    assert follower_ready(100.0, 159.0, interval_s=20, problem=None)[0] is True  # 3 x 20 s
