"""A failed trainer pod is recreated within spec.trainer.maxRestarts, after its backoff, counted once."""
import pytest

from helpers.manifests import RUN
from rlfleet.crds.loader import load_text, local_run_errors
from rlfleet.kube.conditions import find
from rlfleet.operator import builders as b
from rlfleet.operator.reconcile import merge_patch_delta
from rlfleet.operator.run_decide import RunChildren, decide_run
from rlfleet.operator.trainer_decide import backoff_s

T0 = 1_700_000_000.0


def run(status=None, max_restarts=2, checkpoint=True):
    spec = {"modelPath": "/models/base", "rollout": {"replicas": 2, "engine": {"device": "cpu"}},
            "trainer": {"gpus": 0, "maxRestarts": max_restarts},
            "weightSync": {"mountPath": "/snapshots", "snapshotVolume": {"size": "5Gi"}}}
    if checkpoint:
        spec["checkpoint"] = {"intervalSteps": 2}
    obj = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
           "metadata": {"name": "r", "namespace": "ns", "uid": "u", "generation": 1}, "spec": spec}
    if status is not None:
        obj["status"] = status
    return obj


def trainer_pod(phase, *, incarnation=0, exit_code=None, log="", uid="p0", terminating=False):
    cs = [{"name": "trainer", "state": {"terminated": {"exitCode": exit_code, "message": log}}}] \
        if exit_code is not None else [{"name": "trainer", "state": {"running": {}}}]
    meta = {"name": "r-trainer", "uid": uid, "annotations": {"rlfleet.io/restarts": str(incarnation)}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": cs}}


def fleet(r, failed=None):
    f = b.build_rollout_fleet(r)
    f["status"] = {"conditions": [failed]} if failed else {}
    return f


def reconcile(r, pod, now):
    """One pass, then the status written as the next pass reads it."""
    plan = decide_run(r, RunChildren(rollout=fleet(r), trainer=pod, pvc={}), now=now)
    return plan, {**r, "status": {**(r.get("status") or {}), **plan.status}}


def created_pods(plan):
    return [o for o in plan.create if o["kind"] == "Pod"]


def test_a_failed_trainer_is_recreated_after_its_backoff_and_resumes():
    r = run(status={"phase": "Running"})
    failed = trainer_pod("Failed", exit_code=137, log="Killed\nstep 5/10", uid="p0")
    plan, r = reconcile(r, failed, T0)
    assert plan.status["phase"] == "Running", plan.status["message"]
    assert plan.status["trainer"]["failures"] == 1 and plan.status["trainer"]["restarts"] == 0
    assert plan.status["trainer"]["lastFailure"]["exitCode"] == 137
    assert "step 5/10" in plan.status["trainer"]["lastFailure"]["message"]
    assert [e.reason for e in plan.events] == ["TrainerDead"] and plan.delete == []
    assert plan.requeue_after == pytest.approx(backoff_s(0)) and created_pods(plan) == []

    again, r = reconcile(r, failed, T0 + 1)  # within the backoff: counted once, nothing done
    assert again.status["trainer"]["failures"] == 1 and again.events == [] and again.delete == []

    due, r = reconcile(r, failed, T0 + backoff_s(0) + 1)  # the failed pod frees the name
    assert due.delete == [("r-trainer", "p0")] and created_pods(due) == []

    gone, r = reconcile(r, None, T0 + backoff_s(0) + 3)  # not TrainerLost: it is our own deletion
    (pod,) = created_pods(gone)
    assert gone.status["phase"] == "Running"
    assert pod["metadata"]["annotations"]["rlfleet.io/restarts"] == "1"
    assert "--resume" in pod["spec"]["containers"][0]["command"]
    assert [e.reason for e in gone.events] == ["RecreatingTrainer"]

    running, r = reconcile(r, trainer_pod("Running", incarnation=1, uid="p1"), T0 + 60)
    assert running.status["trainer"] == {**running.status["trainer"], "restarts": 1, "failures": 1}
    assert running.status["phase"] == "Running" and created_pods(running) == [] and running.events == []


def test_past_max_restarts_the_run_fails_with_the_trainers_last_log_lines():
    r = run(status={"phase": "Running", "trainer": {"restarts": 1, "failures": 1}}, max_restarts=1)
    plan, _ = reconcile(r, trainer_pod("Failed", incarnation=1, exit_code=1,
                                       log="Traceback ...\nConfigException: Invalid kube-config file"), T0)
    failed = find(plan.status["conditions"], "Failed")
    assert plan.status["phase"] == "Failed" and failed["reason"] == "TrainerFailed"
    assert "ConfigException: Invalid kube-config file" in failed["message"]
    assert "exit code 1" in failed["message"] and "maxRestarts 1" in failed["message"]
    assert created_pods(plan) == [] and plan.delete == []
    assert (plan.status["trainer"]["restarts"], plan.status["trainer"]["failures"]) == (1, 2)


def test_a_trainer_pod_that_vanished_while_running_is_recreated_without_resume_when_nothing_checkpoints():
    r = run(status={"phase": "Running"}, checkpoint=False)
    plan, r = reconcile(r, None, T0)
    assert plan.status["phase"] == "Running" and plan.status["trainer"]["lastFailure"]["reason"] == "TrainerLost"
    later, _ = reconcile(r, None, T0 + backoff_s(0))
    (pod,) = created_pods(later)
    assert "--resume" not in pod["spec"]["containers"][0]["command"]


def test_backoff_doubles_with_each_restart_up_to_its_cap():
    assert [backoff_s(n) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    r = run(status={"phase": "Running", "trainer": {"restarts": 2, "failures": 2}}, max_restarts=3)
    plan, _ = reconcile(r, trainer_pod("Failed", incarnation=2, exit_code=1), T0)
    assert plan.requeue_after == pytest.approx(40)


@pytest.mark.parametrize("why", ["orchestratorFailure", "fleet"])
def test_a_failure_the_run_reported_itself_is_not_restarted(why):
    status = {"phase": "Running"}
    if why == "orchestratorFailure":
        status["orchestratorFailure"] = {"reason": "WatchdogTripped", "message": "503 storm"}
    r = run(status=status)
    failed_fleet = {"type": "Failed", "status": "True", "reason": "EngineCrashLoop", "message": "exit code 2"}
    kids = RunChildren(rollout=fleet(r, failed_fleet if why == "fleet" else None),
                       trainer=trainer_pod("Failed", exit_code=1), pvc={})
    plan = decide_run(r, kids, now=T0)
    assert plan.status["phase"] == "Failed" and created_pods(plan) == [] and plan.delete == []
    assert "TrainerDead" not in [e.reason for e in plan.events]


def test_the_first_trainer_pod_is_created_while_pending_and_not_again_when_terminal():
    first = decide_run(run(), RunChildren(), now=T0)
    (pod,) = created_pods(first)
    assert pod["metadata"]["annotations"]["rlfleet.io/restarts"] == "0"
    assert "--resume" not in pod["spec"]["containers"][0]["command"]
    done = decide_run(run(status={"phase": "Succeeded"}), RunChildren(rollout=fleet(run()), pvc={}), now=T0)
    assert created_pods(done) == []


def test_max_restarts_is_refused_locally_when_set_and_checked_by_the_schema():
    (doc,) = load_text(RUN + "  trainer: {maxRestarts: 2}\n")
    assert [(e.path, e.rule) for e in local_run_errors(doc.obj)] == [("spec.trainer.maxRestarts", "local")]
    (default,) = load_text(RUN)
    assert default.obj.spec.trainer.max_restarts == 3 and local_run_errors(default.obj) == []
    (zero,) = load_text(RUN + "  trainer: {maxRestarts: 0}\n")
    assert local_run_errors(zero.obj) == []
    (bad,) = load_text(RUN + "  trainer: {maxRestarts: -1}\n")
    assert [e.path for e in bad.errors] == ["spec.trainer.maxRestarts"]


def test_the_ranks_the_trainer_pod_reported_survive_the_operators_status_write():
    """status.trainer is shared: the operator writes restarts, the trainer pod its ranks and ready ones;
    the operator's patch names only what it changed, so a report between its read and write is kept."""
    r = run(status={"phase": "Running", "trainer": {"restarts": 0, "failures": 0, "ranks": 2, "ready": 2}})
    plan, _ = reconcile(r, trainer_pod("Failed", exit_code=1, log="boom", uid="p0"), T0)
    assert plan.status["trainer"]["ranks"] == 2 and plan.status["trainer"]["ready"] == 2
    patch = merge_patch_delta(r["status"], plan.status)
    assert patch["trainer"] == {"failures": 1, "lastFailure": plan.status["trainer"]["lastFailure"]}


def test_a_merge_patch_delta_names_only_changes_and_none_removes():
    current = {"a": 1, "b": {"x": 1, "y": 2}, "c": [1], "gone": 3}
    new = {"a": 1, "b": {"x": 1, "y": 5}, "c": [1, 2], "added": {"z": 0}}
    assert merge_patch_delta(current, new) == {"b": {"y": 5}, "c": [1, 2], "gone": None, "added": {"z": 0}}
    assert merge_patch_delta(new, new) == {}
