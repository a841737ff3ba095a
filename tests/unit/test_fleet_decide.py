"""The fleet decision: slots, recreation within budgets and backoff, crash loops, conditions.

Each reconcile is a pure function of (spec, pods, last status, now); a sequence of reconciles is
replayed here by feeding each plan's status into the next call, as the operator does.
"""
import pytest

from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.kube.conditions import find, iso
from rlfleet.operator import builders as b
from rlfleet.operator.fleet_decide import backoff_s, decide_fleet_actions

T0 = 1_700_000_000.0
NAME = "f"


def spec(replicas=2, **recovery):
    rec = {"maxRestartsPerEngine": 2, "maxRestartsPerRun": 10, "backoffBaseSeconds": 1.0, "backoffMaxSeconds": 8.0}
    rec.update(recovery)
    return FleetSpec.model_validate({"replicas": replicas, "minReadyEngines": 1, "recovery": rec,
                                     "health": {"startupTimeoutSeconds": 300.0},
                                     "engine": {"modelPath": "/m", "device": "cpu"}})


def pod(slot, *, phase="Running", ready=True, restarts=0, exit_code=None, message="", annotations=None,
        terminating=False, created=T0, waiting=None, name=None):
    ann = {b.ANN_RESTARTS: str(restarts), **(annotations or {})}
    if exit_code is not None:
        state = {"terminated": {"exitCode": exit_code, "message": message, "reason": "Error"}}
    elif waiting:
        state = {"waiting": {"reason": waiting, "message": message}}
    else:
        state = {"running": {"startedAt": iso(created)}}
    meta = {"name": name or b.engine_pod_name(NAME, slot), "uid": f"uid-{slot}-{restarts}",
            "labels": b.engine_labels(NAME, slot), "annotations": ann, "creationTimestamp": iso(created)}
    if terminating:
        meta["deletionTimestamp"] = iso(created + 1)
    return {"metadata": meta, "status": {
        "phase": phase, "podIP": f"127.0.0.{10 + slot}",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "engine", "state": state}]}}


def decide(s, pods, status, now):
    return decide_fleet_actions(s, pods, status, fleet_name=NAME, now=now, generation=1)


def slot(plan, n):
    return plan.status["engines"][n]


def cond(plan, kind):
    return find(plan.status["conditions"], kind)


def test_new_fleet_creates_every_slot_once():
    plan = decide(spec(), [], None, T0)
    assert plan.create == [(0, 0), (1, 0)] and plan.delete == []
    assert [e["state"] for e in plan.status["engines"]] == ["Pending", "Pending"]
    assert cond(plan, "Ready")["status"] == "False" and cond(plan, "Progressing")["status"] == "True"
    assert [(e.reason, e.message) for e in plan.events] == [("CreatingEngines", "creating 2 engine pod(s): slots 0-1")]
    again = decide(spec(), [], plan.status, T0 + 1)  # the cache has not seen the pods yet
    assert again.create == [(0, 0), (1, 0)] and again.events == []  # same names: the API refuses duplicates


def marks(**by_slot):
    """A fleet status holding only the orchestrator's marks, e.g. marks(s0={...})."""
    return {"orchestrator": {"engines": {k[1:]: v for k, v in by_slot.items()}}}


def test_ready_pods_make_a_ready_fleet_with_urls_and_versions():
    pods = [pod(0), pod(1)]
    plan = decide(spec(), pods, marks(s0={"podUID": "uid-0-0", "weightVersion": "3"},
                                      s1={"podUID": "uid-1-0", "weightVersion": "3"}), T0)
    assert plan.create == [] and plan.delete == []
    assert slot(plan, 1) == {"slot": 1, "pod": "f-engine-1", "state": "Ready", "restarts": 0,
                             "url": "http://127.0.0.11:30000", "weightVersion": "3"}
    assert plan.status["readyReplicas"] == 2 and plan.status["replicas"] == 2
    assert plan.status["weightVersion"] == "3"
    assert plan.status["selector"] == "app.kubernetes.io/component=engine,rlfleet.io/fleet=f"
    assert cond(plan, "Ready")["status"] == "True" and cond(plan, "Degraded")["status"] == "False"


def test_crash_waits_out_the_backoff_then_recreates_delete_first():
    s = spec()
    healthy = decide(s, [pod(0), pod(1)], None, T0)
    crashed = [pod(0, phase="Failed", ready=False, exit_code=1, message="RuntimeError: boom"), pod(1)]
    dead = decide(s, crashed, healthy.status, T0 + 10)
    e = slot(dead, 0)
    assert e["state"] == "Dead" and e["restarts"] == 0
    assert e["lastFailure"] == {"reason": "Crashed", "message": "RuntimeError: boom", "exitCode": 1,
                                "time": iso(T0 + 10)}
    assert dead.delete == [] and dead.requeue_after == pytest.approx(1.0)
    assert [ev.reason for ev in dead.events] == ["EngineDead"] and "exit code 1" in dead.events[0].message
    assert cond(dead, "Degraded")["status"] == "True" and cond(dead, "Ready")["status"] == "True"

    due = decide(s, crashed, dead.status, T0 + 11)
    assert due.delete == [("f-engine-0", "uid-0-0")] and due.create == []
    assert slot(due, 0)["state"] == "Recreating" and slot(due, 0)["restarts"] == 1
    assert due.status["restarts"] == 1

    # The cache still shows the old pod: delete again, count nothing twice.
    stale = decide(s, crashed, due.status, T0 + 12)
    assert stale.delete == [("f-engine-0", "uid-0-0")] and stale.status["restarts"] == 1

    gone = decide(s, [pod(1)], due.status, T0 + 13)
    assert gone.create == [(0, 1)] and gone.status["restarts"] == 1
    assert slot(gone, 0)["lastFailure"]["reason"] == "Crashed"  # history kept for the user


def test_replaying_a_stale_status_gives_the_same_decision():
    s = spec()
    crashed = [pod(0, phase="Failed", ready=False, exit_code=1), pod(1)]
    dead = decide(s, crashed, decide(s, [pod(0), pod(1)], None, T0).status, T0)
    first = decide(s, crashed, dead.status, T0 + 5)
    second = decide(s, crashed, dead.status, T0 + 5)
    assert (first.delete, first.status) == (second.delete, second.status)


def test_operator_restart_mid_recreation_creates_no_second_pod_and_keeps_counts():
    s = spec()
    status = {"restarts": 1, "engines": [{"slot": 0, "state": "Recreating", "restarts": 1},
                                         {"slot": 1, "state": "Ready", "restarts": 0}]}
    replacement = pod(0, phase="Pending", ready=False, restarts=1)
    plan = decide(s, [replacement, pod(1)], status, T0)
    assert plan.create == [] and plan.delete == []
    assert slot(plan, 0)["state"] == "Pending" and slot(plan, 0)["restarts"] == 1
    assert plan.status["restarts"] == 1


def test_restart_count_survives_a_lost_status():
    """A status write lost before the operator restarted: the pod annotation still has the count."""
    plan = decide(spec(), [pod(0, restarts=2), pod(1)], None, T0)
    assert slot(plan, 0)["restarts"] == 2


def test_pod_older_than_the_recorded_recreation_is_deleted_without_counting():
    status = {"restarts": 1, "engines": [{"slot": 0, "state": "Recreating", "restarts": 1}]}
    plan = decide(spec(replicas=1), [pod(0, restarts=0)], status, T0)
    assert plan.delete == [("f-engine-0", "uid-0-0")] and plan.status["restarts"] == 1


def test_orchestrator_dead_mark_recreates_a_running_pod():
    mark = {"podUID": "uid-0-0", "dead": "probe timeout", "deadMessage": "3 probes timed out"}
    dead = decide(spec(replicas=1, backoffBaseSeconds=0.0), [pod(0)], marks(s0=mark), T0)
    assert slot(dead, 0)["lastFailure"]["reason"] == "ProbeTimeout"
    assert slot(dead, 0)["lastFailure"]["message"] == "3 probes timed out"
    assert dead.delete == [("f-engine-0", "uid-0-0")] and slot(dead, 0)["state"] == "Recreating"
    assert "orchestrator" not in dead.status  # the orchestrator's part of the status is not the operator's


def test_a_crashed_container_that_was_also_marked_dead_is_named_by_its_exit():
    """The orchestrator's refused calls and the node's exit report are both true: the exit code says more."""
    mark = {"podUID": "uid-0-0", "dead": "unreachable", "deadMessage": "connection refused"}
    crashed = [pod(0, phase="Failed", ready=False, exit_code=137, message="Killed")]
    plan = decide(spec(replicas=1, backoffBaseSeconds=0.0), crashed, marks(s0=mark), T0)
    failure = slot(plan, 0)["lastFailure"]
    assert failure["reason"] == "Crashed" and failure["exitCode"] == 137
    assert "orchestrator: Unreachable: connection refused" in failure["message"] and "Killed" in failure["message"]


def test_a_mark_of_an_earlier_pod_leaves_its_replacement_alone():
    mark = {"podUID": "uid-0-0", "dead": "probe_failed", "deadMessage": "3 probes timed out", "weightVersion": "2"}
    status = {"restarts": 1, "engines": [{"slot": 0, "state": "Recreating", "restarts": 1}], **marks(s0=mark)}
    plan = decide(spec(replicas=1), [pod(0, restarts=1)], status, T0)
    assert plan.delete == [] and slot(plan, 0)["state"] == "Ready" and "weightVersion" not in slot(plan, 0)
    # Marks under keys that are no slot, or without a pod UID, are not marks.
    junk = {"orchestrator": {"engines": {"x": {"podUID": "uid-0-0", "dead": "a"}, "0": {"dead": "b"}}}}
    assert decide(spec(replicas=1), [pod(0)], junk, T0).delete == []


def test_crash_loop_fails_the_fleet_with_the_engine_log_and_exit_code():
    s = spec(replicas=1)
    log_tail = "Traceback ...\nAssertionError: attention backend not supported"
    status = {"restarts": 2, "engines": [{"slot": 0, "state": "Pending", "restarts": 2}]}
    looping = [pod(0, phase="Failed", ready=False, restarts=2, exit_code=1, message=log_tail)]
    plan = decide(s, looping, status, T0)
    assert slot(plan, 0)["state"] == "Failed"
    assert plan.delete == [] and plan.create == []  # the pod stays for `kubectl logs`
    failed = cond(plan, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "EngineCrashLoop"
    assert "exit code 1" in failed["message"] and "AssertionError: attention backend not supported" in failed["message"]
    assert {"RestartBudgetExhausted", "EngineCrashLoop"} <= {e.reason for e in plan.events}
    settled = decide(s, looping, plan.status, T0 + 60)
    assert settled.create == settled.delete == [] and settled.events == []
    assert cond(settled, "Failed")["lastTransitionTime"] == failed["lastTransitionTime"]


def test_fleet_stays_up_while_enough_engines_remain():
    s = spec(replicas=2)
    status = {"restarts": 2, "engines": [{"slot": 0, "state": "Dead", "restarts": 2,
                                          "lastFailure": {"reason": "Crashed", "time": iso(T0)}},
                                         {"slot": 1, "state": "Ready", "restarts": 0}]}
    plan = decide(s, [pod(0, phase="Failed", ready=False, exit_code=1, restarts=2), pod(1)], status, T0 + 100)
    assert slot(plan, 0)["state"] == "Failed"
    assert cond(plan, "Failed")["status"] == "False" and cond(plan, "Degraded")["status"] == "True"
    assert cond(plan, "Ready")["status"] == "True"


def test_run_budget_stops_recreation():
    s = spec(replicas=2, maxRestartsPerEngine=5, maxRestartsPerRun=1)
    status = {"restarts": 1, "engines": [{"slot": 0, "state": "Ready", "restarts": 1},
                                         {"slot": 1, "state": "Ready", "restarts": 0}]}
    plan = decide(s, [pod(0, restarts=1), pod(1, phase="Failed", ready=False, exit_code=137)], status, T0)
    assert slot(plan, 1)["state"] == "Failed" and plan.delete == []
    assert any("maxRestartsPerRun" in e.message for e in plan.events)


def test_backoff_doubles_and_is_capped():
    s = spec(backoffBaseSeconds=1.0, backoffMaxSeconds=8.0)
    assert [backoff_s(s, n) for n in range(6)] == [1, 2, 4, 8, 8, 8]


def test_second_failure_waits_twice_as_long():
    s = spec(replicas=1, maxRestartsPerEngine=5)
    status = {"restarts": 1, "engines": [{"slot": 0, "state": "Starting", "restarts": 1}]}
    dead = decide(s, [pod(0, phase="Failed", ready=False, exit_code=1, restarts=1)], status, T0)
    assert dead.requeue_after == pytest.approx(2.0) and dead.delete == []
    assert decide(s, [pod(0, phase="Failed", ready=False, exit_code=1, restarts=1)], dead.status, T0 + 2).delete


def test_scale_down_deletes_the_highest_slots_and_strays():
    pods = [pod(0), pod(1), pod(2), pod(0, name="f-engine-x")]
    plan = decide(spec(replicas=2), pods, None, T0)
    assert sorted(n for n, _ in plan.delete) == ["f-engine-2", "f-engine-x"]
    assert len(plan.status["engines"]) == 2


def test_startup_timeout_counts_as_a_failure():
    s = spec(replicas=1)
    slow = [pod(0, ready=False, created=T0)]
    waiting = decide(s, slow, None, T0 + 100)
    assert slot(waiting, 0)["state"] == "Starting" and waiting.requeue_after == pytest.approx(201.0)
    late = decide(s, slow, waiting.status, T0 + 301)
    assert slot(late, 0)["lastFailure"]["reason"] == "StartupTimeout"


def test_pod_that_disappears_while_ready_is_a_failure():
    status = {"restarts": 0, "engines": [{"slot": 0, "state": "Ready", "restarts": 0}]}
    plan = decide(spec(replicas=1, backoffBaseSeconds=0.0), [], status, T0)
    assert slot(plan, 0)["lastFailure"]["reason"] == "PodDeleted"
    assert plan.create == [(0, 1)] and plan.status["restarts"] == 1


def test_terminating_pod_is_waited_for():
    status = {"restarts": 1, "engines": [{"slot": 0, "state": "Recreating", "restarts": 1}]}
    plan = decide(spec(replicas=1), [pod(0, terminating=True)], status, T0)
    assert plan.create == plan.delete == [] and slot(plan, 0)["state"] == "Recreating"
    assert plan.requeue_after is not None


def test_unstartable_container_is_dead_at_once():
    p = pod(0, phase="Pending", ready=False, waiting="ImageNotMapped", message="no local command map")
    plan = decide(spec(replicas=1), [p], None, T0)
    assert slot(plan, 0)["lastFailure"]["reason"] == "ImageNotMapped"


@pytest.mark.parametrize("text,word", [("probe_failed", "ProbeFailed"), ("probe timeout", "ProbeTimeout"),
                                       ("EngineCrashLoop", "EngineCrashLoop"), ("", "Unknown"), ("3x", "X")])
def test_reasons_are_camel_case(text, word):
    from rlfleet.kube.conditions import reason_word
    assert reason_word(text) == word


def test_plan_names_the_slots_recreated_and_given_up():
    """The operator's metrics count these, not Event reasons."""
    s = spec(replicas=2, maxRestartsPerEngine=1, backoffBaseSeconds=0.0)
    status = {"restarts": 1, "engines": [{"slot": 0, "state": "Ready", "restarts": 1},
                                         {"slot": 1, "state": "Ready", "restarts": 0}]}
    crashed = [pod(0, phase="Failed", ready=False, exit_code=1, restarts=1),
               pod(1, phase="Failed", ready=False, exit_code=1)]
    plan = decide(s, crashed, status, T0)
    assert plan.given_up == [0] and plan.recreated == [1]
    assert decide(s, [pod(0), pod(1)], None, T0).recreated == []


def test_a_slot_waiting_out_its_backoff_spends_no_run_budget():
    """Only recreations done count against maxRestartsPerRun: a slot still in backoff leaves the last
    restart to a slot that is due (the decision itself is recovery.decide_dead_slot)."""
    s = spec(replicas=2, maxRestartsPerEngine=5, maxRestartsPerRun=3)
    status = {"restarts": 2, "engines": [
        {"slot": 0, "state": "Dead", "restarts": 2, "lastFailure": {"reason": "Crashed", "time": iso(T0)}},
        {"slot": 1, "state": "Dead", "restarts": 0, "lastFailure": {"reason": "Crashed", "time": iso(T0 - 10)}}]}
    crashed = [pod(0, phase="Failed", ready=False, exit_code=1, restarts=2),
               pod(1, phase="Failed", ready=False, exit_code=1)]
    plan = decide(s, crashed, status, T0 + 1)
    assert slot(plan, 0)["state"] == "Dead" and plan.requeue_after == pytest.approx(3.0)  # 4 s backoff
    assert slot(plan, 1)["state"] == "Recreating" and plan.status["restarts"] == 3


def test_startup_timeout_policy():
    from rlfleet.kube.pods import view_pod
    from rlfleet.operator.fleet_decide import FleetPlan, startup_timeout

    s = spec(replicas=1)
    plan = FleetPlan(status={})
    assert startup_timeout(s, view_pod(pod(0, ready=False)), plan, now=T0 + 299) is None
    assert plan.requeue_after == pytest.approx(2.0)
    assert startup_timeout(s, view_pod(pod(0, ready=False)), plan, now=T0 + 301).reason == "StartupTimeout"
    assert startup_timeout(s, view_pod(pod(0)), FleetPlan(status={}), now=T0 + 1000) is None  # ready


def test_a_fleet_naming_a_run_that_does_not_own_it_says_so_once_per_generation_with_what_it_ignores():
    from rlfleet.operator.fleet_decide import unowned_run_name_events

    named = FleetSpec.model_validate({**spec().model_dump(by_alias=True, mode="json"), "runName": "r",
                                      "router": {"maxRestarts": 9}, "health": {"firstWaitSeconds": 3}})
    (event,) = unowned_run_name_events(named, None, {}, 1)
    assert (event.type, event.reason) == ("Warning", "RunNameNotOwned")
    assert event.message.startswith("spec.runName r: TrainingRun r does not own this fleet")
    assert event.message.endswith("spec.health.firstWaitSeconds, spec.router.maxRestarts take no effect on it")
    assert unowned_run_name_events(named, None, {"observedGeneration": 1}, 1) == []  # said already
    assert len(unowned_run_name_events(named, None, {"observedGeneration": 1}, 2)) == 1  # its spec changed
    assert unowned_run_name_events(named, "r", {}, 1) == []  # the run's own fleet
    assert unowned_run_name_events(spec(), None, {}, 1) == []  # a fleet of no run that says so
