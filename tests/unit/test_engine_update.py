"""An edit of a fleet's engine spec replaces its pods: the pure rule and the fleet decision that applies it.

A sequence of reconciles is replayed as the operator runs them: each plan's status feeds the next call.
"""
from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.kube.conditions import find
from rlfleet.operator import builders as b
from rlfleet.operator.engine_update_decide import SlotPod, outdated, slots_to_replace
from rlfleet.operator.fleet_decide import decide_fleet_actions
from tests.unit.test_fleet_decide import NAME, T0, pod


def fleet_spec(replicas=3, image="lmsysorg/sglang:v0.5.3", **engine):
    return FleetSpec.model_validate({"replicas": replicas, "minReadyEngines": 1,
                                     "recovery": {"maxRestartsPerEngine": 2, "backoffBaseSeconds": 1.0},
                                     "engine": {"modelPath": "/m", "device": "cpu", "image": image, **engine}})


OLD = b.engine_spec_digest(fleet_spec())
NEW = b.engine_spec_digest(fleet_spec(image="lmsysorg/sglang:v0.5.4"))


def built_from(digest, slot, **kw):
    return pod(slot, annotations={b.ANN_ENGINE_SPEC: digest}, **kw)


def decide(spec, pods, status, now=T0, digest=None):
    return decide_fleet_actions(spec, pods, status, fleet_name=NAME, now=now, generation=2,
                                engine_spec=b.engine_spec_digest(spec) if digest is None else digest)


def test_digest_follows_what_the_pod_is_built_from():
    assert OLD != NEW
    assert b.engine_spec_digest(fleet_spec(replicas=5)) == OLD  # replicas: a scale, not a new pod
    assert b.engine_spec_digest(fleet_spec(extraArgs=["--max-running-requests", "8"])) != OLD
    fleet = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
             "metadata": {"name": NAME, "namespace": "ns", "uid": "u"},
             "spec": {"engine": {"modelPath": "/m", "device": "cpu"}}}
    built = b.build_engine_pod(fleet, 0)
    assert built["metadata"]["annotations"][b.ANN_ENGINE_SPEC] == b.engine_spec_digest(b.fleet_spec(fleet))


def test_rule_replaces_what_serves_nothing_at_once_and_one_serving_pod_at_a_time():
    slots = [SlotPod(0, "Ready", OLD), SlotPod(1, "Ready", OLD), SlotPod(2, "Starting", OLD)]
    assert outdated(slots, NEW) == [0, 1, 2]
    assert slots_to_replace(slots, NEW) == [2]  # starting: no capacity lost
    slots[2] = SlotPod(2, "Starting", NEW)
    assert slots_to_replace(slots, NEW) == []  # a slot coming up: wait for it
    slots[2] = SlotPod(2, "Ready", NEW)
    assert slots_to_replace(slots, NEW) == [0]
    slots[0] = SlotPod(0, "Recreating", None)
    assert slots_to_replace(slots, NEW) == []
    # A slot out of budget neither blocks the edit nor keeps its old pod; a Dead one is the restart policy's.
    assert slots_to_replace([SlotPod(0, "Ready", OLD), SlotPod(1, "Failed", NEW)], NEW) == [0]
    assert slots_to_replace([SlotPod(0, "Ready", NEW), SlotPod(1, "Failed", OLD)], NEW) == [1]
    assert slots_to_replace([SlotPod(0, "Ready", OLD), SlotPod(1, "Dead", OLD)], NEW) == []
    # Pods of an earlier operator (no digest) are current.
    assert slots_to_replace([SlotPod(0, "Ready", None)], NEW) == []


def test_an_image_edit_rolls_every_engine_once_without_counting_restarts():
    spec = fleet_spec(image="lmsysorg/sglang:v0.5.4")
    pods = {s: built_from(OLD, s) for s in range(3)}
    status = None
    replaced = []
    for tick in range(40):
        plan = decide(spec, list(pods.values()), status, now=T0 + tick)
        status = plan.status
        for name, _uid in plan.delete:  # the deleted pod goes; the next pass creates it again
            slot_ = int(name.rsplit("-", 1)[1])
            replaced.append(slot_)
            assert sum(1 for e in status["engines"] if e["state"] == "Ready") >= 2
            del pods[slot_]
        for slot_, restarts in plan.create:
            assert restarts == 0
            pods[slot_] = built_from(NEW, slot_)
        if {p["metadata"]["annotations"][b.ANN_ENGINE_SPEC] for p in pods.values()} == {NEW} and len(pods) == 3 \
                and all(e["state"] == "Ready" for e in status["engines"]):
            break
    assert replaced == [0, 1, 2]
    assert status["restarts"] == 0 and [e["restarts"] for e in status["engines"]] == [0, 0, 0]
    assert find(status["conditions"], "Progressing")["reason"] == "Stable"
    assert find(status["conditions"], "Degraded")["status"] == "False"


def test_first_pass_after_the_edit_says_so_in_an_event_and_the_progressing_condition():
    plan = decide(fleet_spec(image="lmsysorg/sglang:v0.5.4"), [built_from(OLD, s) for s in range(3)], None)
    assert plan.delete == [("f-engine-0", "uid-0-0")]
    assert plan.status["engines"][0]["state"] == "Recreating" and "url" not in plan.status["engines"][0]
    assert [(e.reason, e.message) for e in plan.events] == [
        ("UpdatingEngine", "replacing slot 0 (f-engine-0, Ready) with a pod of the fleet's changed engine spec "
                           "(3 of 3 slots on an earlier one)")]
    progressing = find(plan.status["conditions"], "Progressing")
    assert progressing["status"] == "True" and progressing["reason"] == "EnginesUpdating"
    assert progressing["message"].startswith("3 of 3 slots on an earlier engine spec")


def test_a_failed_slot_gets_one_fresh_try_of_the_new_spec():
    spec = fleet_spec(replicas=1, image="lmsysorg/sglang:v0.5.4")
    crashed = built_from(OLD, 0, phase="Failed", ready=False, restarts=2, exit_code=1, message="bad flag")
    failed = {"engines": [{"slot": 0, "pod": "f-engine-0", "state": "Failed", "restarts": 2}], "restarts": 2}
    plan = decide(spec, [crashed], failed)
    assert plan.delete == [("f-engine-0", "uid-0-2")] and plan.status["engines"][0]["state"] == "Recreating"
    gone = decide(spec, [], plan.status, now=T0 + 3)
    assert gone.create == [(0, 2)] and gone.status["restarts"] == 2  # no restart counted for the edit


def test_no_replacement_without_a_digest_to_follow():
    # A run's fleet (engine_spec None): its spec follows the run's, fixed once the run exists.
    plan = decide_fleet_actions(fleet_spec(image="lmsysorg/sglang:v0.5.4"), [built_from(OLD, s) for s in range(3)],
                                None, fleet_name=NAME, now=T0, generation=2)
    assert plan.delete == [] and find(plan.status["conditions"], "Progressing")["status"] == "False"
