"""The TrainingRun decision: children to create, fleet spec sync, phase and conditions from the children."""
from rlfleet.kube.conditions import find
from rlfleet.operator import builders as b
from rlfleet.operator.run_decide import RunChildren, decide_run

T0 = 1_700_000_000.0


def run(status=None, **spec):
    base = {"modelPath": "/models/base", "rollout": {"replicas": 2, "engine": {"device": "cpu"}},
            "trainer": {"gpus": 0}, "weightSync": {"mountPath": "/snapshots", "snapshotVolume": {"size": "5Gi"}}}
    base.update(spec)
    obj = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
           "metadata": {"name": "r", "namespace": "ns", "uid": "u", "generation": 1}, "spec": base}
    if status is not None:
        obj["status"] = status
    return obj


def trainer(phase, exit_code=None, message=""):
    cs = [{"name": "trainer", "state": {"terminated": {"exitCode": exit_code, "message": message}}}] \
        if exit_code is not None else [{"name": "trainer", "state": {"running": {}}}]
    return {"metadata": {"name": "r-trainer"}, "status": {"phase": phase, "startTime": "2026-01-01T00:00:00Z",
                                                          "containerStatuses": cs}}


def fleet_of(r, **status):
    f = b.build_rollout_fleet(r)
    f["status"] = status
    return f


def test_new_run_creates_claim_fleet_and_trainer():
    plan = decide_run(run(), RunChildren(), now=T0)
    assert [o["kind"] for o in plan.create] == ["PersistentVolumeClaim", "RolloutFleet", "Pod"]
    assert plan.status["phase"] == "Pending" and plan.status["ready"] == "0/2"
    assert find(plan.status["conditions"], "Progressing")["status"] == "True"


def test_existing_children_are_not_created_again():
    r = run()
    kids = RunChildren(rollout=fleet_of(r), trainer=trainer("Pending"), pvc={"metadata": {"name": "r-snapshots"}})
    plan = decide_run(r, kids, now=T0)
    assert plan.create == [] and plan.patch_fleet_specs == []


def test_changed_rollout_template_patches_the_fleet_spec():
    r = run()
    current = fleet_of(r)
    r["spec"]["rollout"]["replicas"] = 3
    plan = decide_run(r, RunChildren(rollout=current, trainer=trainer("Running"), pvc={}), now=T0)
    assert plan.patch_fleet_specs[0][:2] == ("RolloutFleet", "r-rollout")
    assert plan.patch_fleet_specs[0][2]["replicas"] == 3
    scaling = [e for e in plan.events if e.reason == "ScalingFleet"]
    assert [e.message for e in scaling] == [
        "scaling RolloutFleet r-rollout from 2 to 3 engine(s): the run's spec.rollout.replicas is 3"]


def test_a_scale_of_the_runs_fleet_itself_is_undone_saying_so():
    r = run()
    scaled = fleet_of(r)
    scaled["spec"]["replicas"] = 5
    plan = decide_run(r, RunChildren(rollout=scaled, trainer=trainer("Running"), pvc={}), now=T0)
    assert plan.patch_fleet_specs[0][2]["replicas"] == 2
    assert [e.message for e in plan.events if e.reason == "ScalingFleet"] == [
        "scaling RolloutFleet r-rollout from 5 to 2 engine(s): the run's spec.rollout.replicas is 2"]
    other = fleet_of(r)
    other["spec"]["health"] = {**other["spec"]["health"], "intervalSeconds": 9}  # restored, but no scaling
    plan = decide_run(r, RunChildren(rollout=other, trainer=trainer("Running"), pvc={}), now=T0)
    assert plan.patch_fleet_specs and not [e for e in plan.events if e.reason == "ScalingFleet"]


def test_an_edit_of_the_runs_fleet_is_set_back_naming_the_fields():
    r = run()
    edited = fleet_of(r)
    edited["spec"]["health"] = {**edited["spec"]["health"], "intervalSeconds": 9}
    edited["spec"]["engine"] = {**edited["spec"]["engine"], "maxTotalTokens": 1234}
    plan = decide_run(r, RunChildren(rollout=edited, trainer=trainer("Running"), pvc={}), now=T0)
    assert plan.patch_fleet_specs[0][2]["health"] == fleet_of(r)["spec"]["health"]
    assert [(e.type, e.message) for e in plan.events if e.reason == "RestoringFleetSpec"] == [
        ("Warning", "setting RolloutFleet r-rollout back to the spec of its run: spec.engine.maxTotalTokens, "
         "spec.health.intervalSeconds differed (a run's fleets follow the TrainingRun; change the run instead)")]
    scaled = fleet_of(r)
    scaled["spec"]["replicas"] = 5  # a scale is told by ScalingFleet alone
    plan = decide_run(r, RunChildren(rollout=scaled, trainer=trainer("Running"), pvc={}), now=T0)
    assert not [e for e in plan.events if e.reason == "RestoringFleetSpec"]
    plan = decide_run(r, RunChildren(rollout=fleet_of(r), trainer=trainer("Running"), pvc={}), now=T0)
    assert plan.patch_fleet_specs == [] and not [e for e in plan.events if e.type == "Warning"]


def test_running_trainer_and_ready_fleet_make_a_ready_run():
    r = run()
    f = fleet_of(r, readyReplicas=2, restarts=1, engines=[{"slot": 0, "state": "Ready", "restarts": 1}],
                 conditions=[{"type": "Ready", "status": "True", "reason": "EnginesReady"}])
    plan = decide_run(r, RunChildren(rollout=f, trainer=trainer("Running"), pvc={}), now=T0)
    st = plan.status
    assert st["phase"] == "Running" and st["ready"] == "2/2" and st["engineRestarts"] == 1
    assert st["startTime"] == "2026-01-01T00:00:00Z"
    assert find(st["conditions"], "Ready")["status"] == "True"
    assert [e.reason for e in plan.events] == ["Running"]


def test_fleet_crash_loop_fails_the_run_with_the_engine_log():
    r = run(status={"phase": "Running"})
    msg = "engine slot 0 failed 3 times ... exit code 1:\nAssertionError: backend"
    f = fleet_of(r, conditions=[{"type": "Failed", "status": "True", "reason": "EngineCrashLoop", "message": msg}])
    plan = decide_run(r, RunChildren(rollout=f, trainer=trainer("Running"), pvc={}), now=T0)
    failed = find(plan.status["conditions"], "Failed")
    assert plan.status["phase"] == "Failed"
    assert failed["reason"] == "EngineCrashLoop" and "AssertionError: backend" in failed["message"]
    assert plan.events[0].type == "Warning"


def test_failed_trainer_fails_the_run_with_its_log_and_nothing_is_recreated():
    r = run(status={"phase": "Running"}, trainer={"gpus": 0, "maxRestarts": 0})
    kids = RunChildren(rollout=fleet_of(r), trainer=trainer("Failed", 2, "usage: rlfleet run ..."), pvc={})
    plan = decide_run(r, kids, now=T0)
    failed = find(plan.status["conditions"], "Failed")
    assert plan.status["phase"] == "Failed" and failed["reason"] == "TrainerFailed"
    assert "exit code 2" in failed["message"] and "usage: rlfleet run" in failed["message"]
    later = decide_run(run(status=plan.status), RunChildren(rollout=fleet_of(r), pvc={}), now=T0 + 60)
    assert later.create == [] and later.status["phase"] == "Failed" and later.events == []


def test_orchestrator_failure_report_fails_the_run():
    r = run(status={"phase": "Running", "orchestratorFailure": {
        "reason": "RolloutEnginesUnavailable", "message": "no engine can serve:\nengine 0: CUDA error"}})
    plan = decide_run(r, RunChildren(rollout=fleet_of(r), trainer=trainer("Running"), pvc={}), now=T0)
    failed = find(plan.status["conditions"], "Failed")
    assert plan.status["phase"] == "Failed" and failed["reason"] == "RolloutEnginesUnavailable"
    assert "CUDA error" in failed["message"] and plan.status["message"].endswith("CUDA error")
    assert "orchestratorFailure" not in plan.status  # the orchestrator's field: never written by the operator


def test_orchestrator_failure_condition_is_kept():
    cond = {"type": "Failed", "status": "True", "reason": "RolloutEnginesUnavailable", "message": "503 storm",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}
    r = run(status={"phase": "Running", "conditions": [cond]})
    plan = decide_run(r, RunChildren(rollout=fleet_of(r), trainer=trainer("Running"), pvc={}), now=T0)
    failed = find(plan.status["conditions"], "Failed")
    assert plan.status["phase"] == "Failed" and failed["reason"] == "RolloutEnginesUnavailable"
    assert failed["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def test_succeeded_run_scales_its_fleets_to_zero():
    r = run(status={"phase": "Running"})
    plan = decide_run(r, RunChildren(rollout=fleet_of(r), trainer=trainer("Succeeded", 0), pvc={}), now=T0)
    assert plan.status["phase"] == "Succeeded" and plan.status["completionTime"]
    done = decide_run(run(status=plan.status), RunChildren(rollout=fleet_of(r), trainer=trainer("Succeeded", 0),
                                                           pvc={}), now=T0 + 1)
    assert done.patch_fleet_specs[0][2]["replicas"] == 0
    assert [e.message for e in done.events if e.reason == "ScalingFleet"] == [
        "scaling RolloutFleet r-rollout from 2 to 0 engine(s): the run succeeded"]


def test_trainer_vanishing_while_running_fails_the_run():
    r = run(status={"phase": "Running"}, trainer={"gpus": 0, "maxRestarts": 0})
    plan = decide_run(r, RunChildren(rollout=fleet_of(r), pvc={}), now=T0)
    assert plan.status["phase"] == "Failed" and find(plan.status["conditions"], "Failed")["reason"] == "TrainerLost"
    assert plan.create == []


def test_named_claim_is_not_created():
    r = run(weightSync={"mountPath": "/s", "snapshotVolume": {"claimName": "mine"}})
    assert "PersistentVolumeClaim" not in [o["kind"] for o in decide_run(r, RunChildren(), now=T0).create]


def test_adopted_failure_is_the_orchestrators_not_the_operators_own():
    from rlfleet.operator.run_decide import adopted_failure

    reported = {"reason": "rollout engines unavailable", "message": "503 storm"}
    assert adopted_failure(reported, None) == ("RolloutEnginesUnavailable", "503 storm")
    kept = {"type": "Failed", "status": "True", "reason": "RolloutEnginesUnavailable", "message": "m"}
    assert adopted_failure(None, kept) == ("RolloutEnginesUnavailable", "m")
    assert adopted_failure(None, {**kept, "reason": "TrainerFailed"}) == (None, None)
    assert adopted_failure({}, {**kept, "status": "False"}) == (None, None)


def test_a_terminal_phase_is_final():
    from rlfleet.operator.run_decide import next_phase

    failed = {"type": "Failed", "status": "True", "reason": "TrainerFailed", "message": "exit code 2"}
    change = next_phase("Failed", adopted=(None, None), old_failed=failed, old_message="m", trainer=trainer("Running"),
                        fleet_conditions=[], run_name="r")
    assert (change.phase, change.message, change.failed_reason, change.failed_message) == (
        "Failed", "m", "TrainerFailed", "exit code 2")
    assert next_phase("Succeeded", adopted=(None, None), old_failed=None, old_message="done", trainer=None,
                      fleet_conditions=[], run_name="r").phase == "Succeeded"


def test_fleet_specs_are_patched_while_running_and_to_zero_on_success_never_after_failure():
    from rlfleet.operator.run_decide import drifted_fleet_specs

    r = run()
    desired, current = b.build_rollout_fleet(r), fleet_of(run(rollout={"replicas": 3, "engine": {"device": "cpu"}}))
    assert [p[2]["replicas"] for p in drifted_fleet_specs("Running", [(desired, current), (None, None)])] == [2]
    assert drifted_fleet_specs("Running", [(desired, b.build_rollout_fleet(r))]) == []
    assert [p[2]["replicas"] for p in drifted_fleet_specs("Succeeded", [(desired, current)])] == [0]
    assert drifted_fleet_specs("Failed", [(desired, current)]) == []


def test_one_event_per_phase_change():
    from rlfleet.operator.run_decide import PhaseChange, phase_events

    assert phase_events("Running", PhaseChange("Running", "training")) == []
    (ev,) = phase_events("Running", PhaseChange("Failed", "x" * 2000, "TrainerLost", "gone"))
    assert (ev.type, ev.reason, len(ev.message)) == ("Warning", "TrainerLost", 1000)
    (ev,) = phase_events("Pending", PhaseChange("Running", ""))
    assert (ev.type, ev.reason, ev.message) == ("Normal", "Running", "Running")


def test_a_run_spec_the_models_reject_fails_the_run_and_creates_nothing():
    r = run(rollout={"replicas": 1, "minReadyEngines": 2, "engine": {"device": "cpu"}})
    plan = decide_run(r, RunChildren(), now=T0)
    failed = find(plan.status["conditions"], "Failed")
    assert plan.create == [] and plan.status["phase"] == "Failed" and failed["reason"] == "InvalidSpec"
    assert "minReadyEngines" in plan.status["message"] and "engines" not in plan.status
    assert [e.reason for e in plan.events] == ["InvalidSpec"]


def test_a_local_runs_snapshot_directory_on_the_cluster_fails_the_run_naming_the_field():
    r = run(weightSync={"snapshotVolume": {"localPath": "/data/snapshots"}})
    plan = decide_run(r, RunChildren(), now=T0)
    failed = find(plan.status["conditions"], "Failed")
    assert plan.create == [] and plan.status["phase"] == "Failed" and failed["reason"] == "InvalidSpec"
    assert plan.status["message"].startswith("spec.weightSync.snapshotVolume.localPath: a directory of a local run")
    assert decide_run(run(), RunChildren(), now=T0).status["phase"] != "Failed"
    # Checked at admission: a run an earlier operator let start goes on (its spec is fixed once it exists).
    running = run(status={"phase": "Running"}, weightSync={"snapshotVolume": {"localPath": "/data/snapshots"}})
    assert decide_run(running, RunChildren(), now=T0).status["phase"] == "Running"


def test_a_trainer_of_several_ranks_on_one_node_is_one_trainer_pod():
    plan = decide_run(run(trainer={"backend": "torch", "gpus": 0, "dataParallelSize": 2}), RunChildren(), now=T0)
    assert plan.status["phase"] != "Failed", plan.status
    pods = [obj for obj in plan.create if obj["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == ["r-trainer"]
    assert pods[0]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "2"


def test_a_broadcast_run_gets_its_children_and_a_trainer_pod_with_the_update_group_port():
    plan = decide_run(run(weightSync={"mode": "broadcast", "mountPath": "/snapshots"}), RunChildren(), now=T0)
    assert plan.status["phase"] == "Pending" and find(plan.status["conditions"], "Failed")["status"] == "False"
    (pod,) = [o for o in plan.create if o["kind"] == "Pod"]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert ports == {"metrics": 9400, "update-group": 29600}


def test_a_run_that_splits_the_model_gets_its_fleets_only_after_the_trainers_layout_check():
    """Only the trainer pod reads the model: with tensor or pipeline parallelism the operator creates the
    claim and the trainer first, the fleets (and their API-key Secrets, which the trainer already needs)
    once status.trainer.layoutChecked is on the run; a failed check fails the run with no fleet made."""
    spec = {"trainer": {"gpus": 0, "backend": "megatron", "tensorParallelSize": 2}, "eval": {
        "posture": "fleet", "intervalSteps": 2, "datasets": [{"name": "rotate", "task": "rotate"}],
        "fleet": {"replicas": 1}}}
    first = decide_run(run(**spec), RunChildren(), now=T0)
    assert [o["kind"] for o in first.create] == ["PersistentVolumeClaim", "Pod"]
    assert first.api_key_fleets == ["r-rollout", "r-eval"]  # the trainer's env reads the rollout fleet's key
    assert first.status["message"] == ("waiting for the trainer pod to check tensorParallelSize 2 x "
                                       "pipelineParallelSize 1 against the model before the fleets are created")
    kids = RunChildren(trainer=trainer("Running"), pvc={"metadata": {"name": "r-snapshots"}})
    waiting = decide_run(run(status={"phase": "Pending", "trainer": {"restarts": 0}}, **spec), kids, now=T0)
    assert waiting.create == [] and waiting.status["trainer"].get("layoutChecked") is None
    checked = run(status={"phase": "Running", "trainer": {"restarts": 0, "layoutChecked": True}}, **spec)
    plan = decide_run(checked, kids, now=T0)
    assert [o["kind"] for o in plan.create] == ["RolloutFleet", "EvalFleet"]
    assert plan.api_key_fleets == ["r-rollout", "r-eval"]
    assert plan.status["trainer"]["layoutChecked"] is True  # the trainer's report, carried as read
    refused = run(status={"phase": "Pending", "orchestratorFailure": {
        "reason": "TrainerSetupFailed",
        "message": "spec.trainer.tensorParallelSize 3 does not divide the model's num_attention_heads 4"}}, **spec)
    failed = decide_run(refused, kids, now=T0)
    assert failed.status["phase"] == "Failed" and failed.create == []
    assert "num_attention_heads 4" in find(failed.status["conditions"], "Failed")["message"]


def test_a_run_that_does_not_split_the_model_creates_its_fleets_at_once():
    plan = decide_run(run(trainer={"gpus": 0, "dataParallelSize": 2}), RunChildren(), now=T0)
    assert [o["kind"] for o in plan.create] == ["PersistentVolumeClaim", "RolloutFleet", "Pod"]
    assert plan.api_key_fleets == ["r-rollout"]
    nothing_new = decide_run(run(status={"phase": "Running"}), RunChildren(
        rollout=fleet_of(run()), trainer=trainer("Running"), pvc={"metadata": {"name": "r-snapshots"}}), now=T0)
    assert nothing_new.create == [] and nothing_new.api_key_fleets == []
