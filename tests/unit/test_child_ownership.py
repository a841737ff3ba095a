"""Children are matched by their controller ownerReference's UID, and refused children become conditions.

Pure logic: which objects a parent owns (a label says nothing), which API server answers are refusals
for good, which clear by themselves, and what the owner's status and Events then say.
"""
from __future__ import annotations

from rlfleet.crds import reasons
from rlfleet.crds.specs import RecoverySpec
from rlfleet.kube.conditions import find
from rlfleet.kube.ownership import controller_uid, owned_by, owned_router_pods, partition
from rlfleet.kube.refusals import Rejection, Verdict, classify, rejection
from rlfleet.operator import builders as b
from rlfleet.operator import rejections
from rlfleet.operator.run_decide import RunChildren, decide_run
from rlfleet.orchestrator.fleet.k8s_backend import KubernetesBackend


def obj(name: str, uid: str, *owners: tuple[str, bool], kind: str = "Pod", ready: bool = False,
        ip: str | None = None) -> dict:
    refs = [{"apiVersion": "v1", "kind": "X", "name": "x", "uid": o, "controller": c} for o, c in owners]
    meta = {"name": name, "uid": uid, "labels": b.router_labels("f")}
    if refs:
        meta["ownerReferences"] = refs
    status = {"phase": "Running", "podIP": ip,
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]} if ip else {}
    return {"kind": kind, "metadata": meta, "status": status}


def test_only_the_controller_reference_counts():
    assert controller_uid(obj("a", "1", ("other", False), ("fleet", True))) == "fleet"
    assert controller_uid(obj("a", "1", ("fleet", False))) is None  # an owner, not the controller
    assert not owned_by(obj("a", "1"), "fleet") and not owned_by(obj("a", "1", ("fleet", True)), None)
    owned, foreign = partition([obj("a", "1", ("fleet", True)), obj("decoy", "2"), obj("b", "3", ("run", True))],
                               "fleet")
    assert [o["metadata"]["name"] for o in owned] == ["a"]
    assert [o["metadata"]["name"] for o in foreign] == ["decoy", "b"]


def test_router_pods_are_the_fleets_only_through_deployment_and_replicaset():
    deployment = obj("f-router", "dep", ("fleet", True), kind="Deployment")
    replica_set = obj("f-router-abc", "rs", ("dep", True), kind="ReplicaSet")
    stray_set = obj("f-router-xyz", "rs2", ("other-dep", True), kind="ReplicaSet")
    real = obj("f-router-abc-1", "p1", ("rs", True), ready=True, ip="10.0.0.1")
    decoys = [obj("decoy", "p2", ready=True, ip="10.6.6.6"),  # labels only
              obj("decoy-2", "p3", ("rs2", True), ready=True, ip="10.6.6.7"),  # another Deployment's set
              obj("decoy-3", "p4", ("dep", True), ready=True, ip="10.6.6.8")]  # claims the Deployment itself
    pods = [*decoys, real]
    assert owned_router_pods(pods, [replica_set, stray_set], deployment, "fleet") == [real]
    assert owned_router_pods(pods, [replica_set], deployment, "another-fleet") == []  # a foreign Deployment
    assert owned_router_pods(pods, [replica_set], None, "fleet") == []


def test_which_refusals_are_for_good():
    assert classify(422, 'Pod "x" is invalid: spec.containers[0].image: Required value') is Verdict.PERMANENT
    assert classify(400, "bad request") is Verdict.PERMANENT
    assert classify(403, 'pods "x" is forbidden: violates PodSecurity "restricted:latest": '
                         "allowPrivilegeEscalation != false") is Verdict.PERMANENT
    assert classify(403, 'pods "x" is forbidden: maximum cpu usage per Container is 500m, but limit is 2')\
        is Verdict.PERMANENT
    # Cleared by someone else's action: shown, and retried with backoff.
    assert classify(403, 'pods "x" is forbidden: exceeded quota: q, requested: pods=1, used: pods=2') is Verdict.WAIT
    assert classify(403, 'pods "x" is forbidden: error looking up service account ns/rlfleet-trainer: '
                         'serviceaccount "rlfleet-trainer" not found') is Verdict.WAIT
    assert classify(403, 'pods is forbidden: User "system:serviceaccount:s:op" cannot create resource "pods"')\
        is Verdict.WAIT
    for status in (0, 401, 404, 429, 500, 503, 504):  # not refusals: retried quietly
        assert classify(status, "x") is Verdict.RETRY
        assert rejection("Pod", "x", status, "x") is None
    r = rejection("Pod", "r-trainer", 403, "violates PodSecurity")
    assert r == Rejection("Pod", "r-trainer", "violates PodSecurity", True, 403)
    assert r.text() == "the API server refused Pod r-trainer: violates PodSecurity"


FORBIDDEN = Rejection("Pod", "f-engine-0", 'pods "f-engine-0" is forbidden: maximum cpu usage per Container is 1',
                      True, 403)
QUOTA = Rejection("Pod", "f-engine-1", 'pods "f-engine-1" is forbidden: exceeded quota: q', False, 403)


def status_with(*conds: dict) -> dict:
    return {"readyReplicas": 0, "conditions": list(conds)}


def cond(kind: str, status: str, reason: str, message: str = "", generation: int = 1) -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": generation}


def test_a_refused_child_sets_child_rejected_with_the_servers_message():
    fresh = status_with(cond("Failed", "False", "AsExpected"), cond("Degraded", "False", "AsExpected"),
                        cond("Progressing", "True", "EnginesStarting"))
    out = rejections.apply(fresh, [FORBIDDEN, QUOTA], fresh["conditions"], now=1e9, generation=1)
    failed, degraded = find(out["conditions"], "Failed"), find(out["conditions"], "Degraded")
    assert failed["status"] == "True" and failed["reason"] == reasons.CHILD_REJECTED
    assert "maximum cpu usage per Container is 1" in failed["message"] and "Pod f-engine-0" in failed["message"]
    assert find(out["conditions"], "Progressing")["status"] == "False"
    assert degraded["status"] == "True" and degraded["reason"] == reasons.CHILD_REJECTED
    assert "exceeded quota" in degraded["message"]
    events = rejections.events([FORBIDDEN, QUOTA], fresh["conditions"])
    assert [(e.type, e.reason) for e in events] == [("Warning", "ChildRejected")] * 2
    # The next pass says nothing new: no Event, the condition held for this generation.
    assert rejections.events([FORBIDDEN, QUOTA], out["conditions"]) == []
    assert rejections.held(out["conditions"], 1) == failed
    assert rejections.held(out["conditions"], 2) is None  # a changed spec is tried again
    kept = rejections.carry(fresh, out["conditions"], 1)
    assert find(kept["conditions"], "Failed") == failed and find(kept["conditions"], "Degraded") == degraded
    # A retry that succeeds clears Degraded; the held Failed stays.
    cleared = rejections.apply(fresh, [], out["conditions"], now=1e9 + 5, generation=1)
    assert find(cleared["conditions"], "Degraded")["status"] == "False"
    assert find(cleared["conditions"], "Failed") == failed
    assert rejections.apply(fresh, [], fresh["conditions"], now=1e9, generation=1) == fresh


def test_foreign_children_are_reported_once_each():
    seen: set[str] = set()
    decoy = obj("decoy", "d1")
    first = rejections.foreign_events("RolloutFleet", "f", [("Pod", decoy)], seen)
    assert [(e.type, e.reason) for e in first] == [("Warning", reasons.FOREIGN_CHILD_IGNORED)]
    assert "Pod decoy" in first[0].message and "not owned" in first[0].message
    assert rejections.foreign_events("RolloutFleet", "f", [("Pod", decoy)], seen) == []


RUN = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
       "metadata": {"name": "r", "namespace": "ns", "uid": "run-uid", "generation": 1},
       "spec": {"modelPath": "/models/base", "rollout": {"replicas": 1, "engine": {"device": "cpu"}},
                "trainer": {"gpus": 0}, "weightSync": {"mountPath": "/snapshots", "snapshotVolume": {"size": "5Gi"}}}}


def test_a_run_whose_child_is_refused_fails_with_child_rejected_at_once():
    trainer = Rejection("Pod", "r-trainer", 'pods "r-trainer" is forbidden: maximum cpu usage per Container is 1',
                        True, 403)
    plan = decide_run(RUN, RunChildren(), now=1e9, rejected=[trainer])
    assert plan.status["phase"] == "Failed"
    failed = find(plan.status["conditions"], "Failed")
    assert failed["reason"] == reasons.CHILD_REJECTED and "maximum cpu usage" in failed["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", reasons.CHILD_REJECTED)]
    # The next pass: terminal, nothing created again, the reason kept.
    again = decide_run({**RUN, "status": plan.status}, RunChildren(), now=1e9 + 30)
    assert again.create == [] and find(again.status["conditions"], "Failed")["reason"] == reasons.CHILD_REJECTED


async def test_the_backend_ignores_engine_labelled_pods_the_fleet_does_not_own():
    backend = KubernetesBackend(None, namespace="ns", fleet="f", fleet_uid="fleet-uid", replicas=2, min_ready=1,
                                recovery=RecoverySpec())

    def engine(slot: int, owner: str | None) -> dict:
        meta = {"name": b.engine_pod_name("f", slot), "uid": f"p{slot}", "labels": b.engine_labels("f", slot),
                "annotations": {b.ANN_RESTARTS: "0"}}
        if owner:
            meta["ownerReferences"] = [{"kind": "RolloutFleet", "name": "f", "uid": owner, "controller": True}]
        return {"metadata": meta, "status": {"phase": "Running", "podIP": f"10.0.0.{slot + 1}",
                                             "conditions": [{"type": "Ready", "status": "True"}]}}

    await backend._on_pods_listed([engine(0, "fleet-uid"), engine(1, None)])
    slots = backend.engines()
    assert slots[0].url == "http://10.0.0.1:30000" and slots[1].url is None
    await backend._on_pod_event("ADDED", engine(1, "another-fleet-of-that-name"))
    assert backend.engines()[1].url is None
