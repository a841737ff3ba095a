"""A trainer across nodes: the group's pod specs, its API rules, its ranks and its gang restarts (pure parts)."""
import pytest

from helpers.manifests import RUN, errors
from rlfleet.crds.loader import load_text, local_run_errors
from rlfleet.kube.conditions import find
from rlfleet.operator import builders as b
from rlfleet.operator.run_decide import RunChildren, decide_run
from rlfleet.operator.trainer_decide import backoff_s
from rlfleet.orchestrator.run.trainer_group import leader_address, node_rank_from_env
from rlfleet.trainer.launch import NodePlan

T0 = 1_700_000_000.0


def run(status=None, *, nodes=2, data=4, gpus=0, max_restarts=2, mode="disk", **trainer):
    spec = {"modelPath": "/models/base", "rollout": {"replicas": 1, "engine": {"device": "cpu"}},
            "trainer": {"gpus": gpus, "nodes": nodes, "dataParallelSize": data, "maxRestarts": max_restarts,
                        "promptsPerStep": 4, "samplesPerPrompt": 4, **trainer},
            "weightSync": {"mode": mode, "mountPath": "/snapshots", "snapshotVolume": {"size": "5Gi"}},
            "checkpoint": {"intervalSteps": 1}}
    obj = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
           "metadata": {"name": "r", "namespace": "ns", "uid": "u", "generation": 1}, "spec": spec}
    if status is not None:
        obj["status"] = status
    return obj


def env_of(pod) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


# --- the group's pods -------------------------------------------------------------------------------

def test_a_trainer_of_two_nodes_is_two_pods_owned_by_the_run_each_with_its_ranks_and_the_claim():
    pods = b.build_trainer_pods(run())
    assert [p["metadata"]["name"] for p in pods] == ["r-trainer-0", "r-trainer-1"]
    for node, pod in enumerate(pods):
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "u"
        assert pod["metadata"]["labels"]["rlfleet.io/trainer-node"] == str(node)
        assert pod["metadata"]["labels"]["rlfleet.io/run"] == "r"
        assert env_of(pod)["RLFLEET_TRAINER_NODE"] == str(node)
        container = pod["spec"]["containers"][0]
        assert container["resources"]["requests"]["cpu"] == "2"  # world 4 over 2 nodes: 2 ranks a pod
        assert container["command"][:3] == ["rlfleet", "run", "--kubernetes"]
        assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "r-snapshots"
        assert b.trainer_pod_node(pod) == node
    # Pod 0 holds the rendezvous (and rank 0); the others only connect to it.
    rendezvous = {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"}
    assert rendezvous in pods[0]["spec"]["containers"][0]["ports"]
    assert [p["name"] for p in pods[1]["spec"]["containers"][0]["ports"]] == ["metrics"]


def test_a_trainer_of_one_node_keeps_its_single_pod_and_name():
    (pod,) = b.build_trainer_pods(run(nodes=1, data=2))
    assert pod["metadata"]["name"] == "r-trainer"
    assert "rlfleet.io/trainer-node" not in pod["metadata"]["labels"]
    assert "RLFLEET_TRAINER_NODE" not in env_of(pod)
    assert b.trainer_pod_node(pod) == 0


def test_gpu_pods_of_a_group_get_their_gpus_and_no_cpu_request_of_their_own():
    pods = b.build_trainer_pods(run(gpus=2, data=4, backend="torch"))
    for pod in pods:
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == "2" and "cpu" not in resources.get("requests", {})


def test_a_node_outside_the_group_is_refused_by_the_builder():
    with pytest.raises(ValueError, match="trainer node 2 is outside spec.trainer.nodes 2"):
        b.build_trainer_pod(run(), node=2)


def test_the_trainer_policy_lets_the_groups_pods_reach_each_other_and_the_engines_reach_pod_0():
    (policy,) = b.build_trainer_network_policies(run())
    assert policy["metadata"]["name"] == "r-trainer"
    trainer = {"matchLabels": {"app.kubernetes.io/component": "trainer", "rlfleet.io/run": "r"}}
    assert policy["spec"]["podSelector"] == trainer
    peers, metrics = policy["spec"]["ingress"]
    assert peers == {"from": [{"podSelector": trainer}],
                     "ports": [{"port": 29500, "protocol": "TCP"},
                               {"port": 32768, "endPort": 60999, "protocol": "TCP"}]}
    assert metrics == {"ports": [{"port": 9400, "protocol": "TCP"}]}
    trainer_policy, group_policy = b.build_trainer_network_policies(run(mode="broadcast"))
    assert [i.get("from", [{}])[0].get("podSelector") for i in trainer_policy["spec"]["ingress"]] == [
        {"matchLabels": {"app.kubernetes.io/component": "engine", "rlfleet.io/fleet": "r-rollout"}}, trainer, None]
    assert group_policy["metadata"]["name"] == "r-update-group"
    assert b.build_trainer_network_policies(run(nodes=1, data=2)) == []  # one pod in disk mode: as before


# --- the API rules -----------------------------------------------------------------------------------

@pytest.mark.parametrize("trainer, path, says", [
    ("{gpus: 0, nodes: 2, dataParallelSize: 3}", "spec.trainer.nodes",
     "tensorParallelSize x pipelineParallelSize x dataParallelSize (1 x 1 x 3 = 3) must be a multiple of nodes (2)"),
    ("{gpus: 0, nodes: 4, dataParallelSize: 2}", "spec.trainer.nodes",
     "(1 x 1 x 2 = 2) must be a multiple of nodes (4)"),
    ("{gpus: 2, nodes: 2, dataParallelSize: 2}", "spec.trainer.gpus", "gpus x nodes (2 x 2 = 4) must equal"),
])
def test_a_world_that_does_not_split_evenly_over_the_nodes_is_refused_naming_the_field_and_numbers(trainer, path,
                                                                                                   says):
    found = errors(RUN + f"  trainer: {trainer}\n")
    assert any(p == path and says in m for p, m in found), found


def test_the_rendezvous_port_is_not_the_metrics_port_of_a_group_and_a_group_does_not_run_locally():
    found = errors(RUN + "  metricsPort: 29500\n  trainer: {gpus: 0, nodes: 2, dataParallelSize: 2}\n")
    assert any(p == "spec.metricsPort" and "rendezvous port" in m for p, m in found), found
    assert errors(RUN + "  metricsPort: 29500\n  trainer: {gpus: 0, dataParallelSize: 2}\n") == []
    (doc,) = load_text(RUN + "  trainer: {gpus: 0, nodes: 2, dataParallelSize: 4}\n")
    assert doc.errors == [] and doc.obj.spec.trainer.ranks_per_node == 2
    assert [e.path for e in local_run_errors(doc.obj)] == ["spec.trainer.nodes"]


# --- ranks ---------------------------------------------------------------------------------------------

def test_global_ranks_are_node_rank_times_ranks_per_node_plus_local_rank():
    assert list(NodePlan(4, 2, 0).ranks) == [0, 1] and list(NodePlan(4, 2, 1).ranks) == [2, 3]
    assert NodePlan(8, 4, 3).global_rank(1) == 7 and NodePlan(8, 4, 3).local == 2
    assert list(NodePlan(3).ranks) == [0, 1, 2]
    with pytest.raises(ValueError, match="does not split evenly"):
        NodePlan(3, 2, 0)
    with pytest.raises(ValueError, match="node rank 2 is outside a group of 2"):
        NodePlan(4, 2, 2)


def test_a_pods_node_rank_comes_from_its_env_and_a_wrong_one_is_named():
    assert node_rank_from_env(2, {"RLFLEET_TRAINER_NODE": "1"}) == 1
    for bad in ({}, {"RLFLEET_TRAINER_NODE": "2"}, {"RLFLEET_TRAINER_NODE": "x"}):
        with pytest.raises(ValueError, match=r"\$RLFLEET_TRAINER_NODE is .*node rank 0..1"):
            node_rank_from_env(2, bad)


def test_pod_0s_address_counts_only_for_the_same_incarnation_and_not_while_it_is_deleted():
    pod0 = {"metadata": {"annotations": {"rlfleet.io/restarts": "1"}}, "status": {"podIP": "10.0.0.7"}}
    assert leader_address(pod0, "1") == "10.0.0.7"
    assert leader_address(pod0, "0") is None  # the failed group's pod 0: not this group's
    assert leader_address({**pod0, "metadata": {**pod0["metadata"], "deletionTimestamp": "t"}}, "1") is None
    assert leader_address({**pod0, "status": {}}, "1") is None and leader_address(None, "1") is None


# --- gang semantics ---------------------------------------------------------------------------------------

def pod(node, phase, *, incarnation=0, exit_code=None, log="", finished="2026-01-01T00:00:05Z", uid=None,
        terminating=False):
    state = {"terminated": {"exitCode": exit_code, "message": log, "finishedAt": finished}} \
        if exit_code is not None else {"running": {}}
    meta = {"name": f"r-trainer-{node}", "uid": uid or f"u{node}-{incarnation}",
            "labels": {"rlfleet.io/trainer-node": str(node)}, "annotations": {"rlfleet.io/restarts": str(incarnation)}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:09Z"
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state}]}}


def reconcile(r, pods, now):
    leader = next((p for p in pods if p["metadata"]["labels"]["rlfleet.io/trainer-node"] == "0"), None)
    plan = decide_run(r, RunChildren(rollout=b.build_rollout_fleet(r), trainer=leader, trainer_group=list(pods),
                                     pvc={}), now=now)
    return plan, {**r, "status": {**(r.get("status") or {}), **plan.status}}


def created(plan):
    return [o for o in plan.create if o["kind"] == "Pod"]


def test_the_whole_group_is_created_while_pending_and_a_missing_pod_is_added_before_the_run_runs():
    first = decide_run(run(), RunChildren(), now=T0)
    assert [p["metadata"]["name"] for p in created(first)] == ["r-trainer-0", "r-trainer-1"]
    half, _ = reconcile(run(status={"phase": "Pending"}), [pod(0, "Pending")], T0)
    assert [p["metadata"]["name"] for p in created(half)] == ["r-trainer-1"]
    assert half.status["phase"] == "Pending"


def test_one_failed_pod_fails_the_group_one_restart_and_the_whole_group_comes_back_with_resume():
    r = run(status={"phase": "Running"})
    group = [pod(0, "Running"), pod(1, "Failed", exit_code=137, log="rank 3: Killed")]
    plan, r = reconcile(r, group, T0)
    assert plan.status["phase"] == "Running", plan.status["message"]
    assert (plan.status["trainer"]["restarts"], plan.status["trainer"]["failures"]) == (0, 1)
    assert "r-trainer-1 failed with exit code 137" in plan.status["trainer"]["lastFailure"]["message"]
    assert "rank 3: Killed" in plan.status["trainer"]["lastFailure"]["message"]
    assert [e.reason for e in plan.events] == ["TrainerDead"] and "trainer group (2 pods)" in plan.events[0].message
    assert plan.delete == [] and created(plan) == []

    # Pod 0 fails too as its rank 0 loses a peer: still the same one failure.
    group = [pod(0, "Failed", exit_code=1, log="gloo: connection closed", finished="2026-01-01T00:00:06Z"), group[1]]
    again, r = reconcile(r, group, T0 + 1)
    assert again.status["trainer"]["failures"] == 1 and again.events == [] and again.delete == []

    due, r = reconcile(r, group, T0 + backoff_s(0) + 1)  # every pod of the group is deleted, as one
    assert sorted(due.delete) == [("r-trainer-0", "u0-0"), ("r-trainer-1", "u1-0")] and created(due) == []
    terminating = [pod(0, "Failed", exit_code=1, terminating=True), pod(1, "Failed", exit_code=137, terminating=True)]
    waiting, r = reconcile(r, terminating, T0 + backoff_s(0) + 2)
    assert waiting.delete == [] and created(waiting) == [] and waiting.status["phase"] == "Running"

    gone, r = reconcile(r, [], T0 + backoff_s(0) + 4)  # not TrainerLost: our own deletion
    pods = created(gone)
    assert [p["metadata"]["name"] for p in pods] == ["r-trainer-0", "r-trainer-1"]
    for p in pods:
        assert p["metadata"]["annotations"]["rlfleet.io/restarts"] == "1"
        assert "--resume" in p["spec"]["containers"][0]["command"]
    assert [e.reason for e in gone.events] == ["RecreatingTrainer"]

    # Until the whole new group is seen the recreation is pending (a pod missing is created, not a failure).
    partly, r = reconcile(r, [pod(0, "Pending", incarnation=1)], T0 + 60)
    assert [p["metadata"]["name"] for p in created(partly)] == ["r-trainer-1"]
    assert partly.status["trainer"]["restarts"] == 0 and partly.delete == []
    running, r = reconcile(r, [pod(0, "Running", incarnation=1), pod(1, "Running", incarnation=1)], T0 + 70)
    assert (running.status["trainer"]["restarts"], running.status["trainer"]["failures"]) == (1, 1)
    assert running.status["phase"] == "Running" and created(running) == [] and running.events == []


def test_the_pod_that_failed_first_is_named_pod_0_last_among_equals():
    r = run(status={"phase": "Running"}, max_restarts=0)
    same_time = [pod(0, "Failed", exit_code=1, log="rank 0: peer gone"),
                 pod(1, "Failed", exit_code=3, log="rank 2: oom")]
    plan, _ = reconcile(r, same_time, T0)
    failed = find(plan.status["conditions"], "Failed")
    assert plan.status["phase"] == "Failed" and failed["reason"] == "TrainerFailed"
    assert "r-trainer-1 failed with exit code 3" in failed["message"] and "rank 2: oom" in failed["message"]
    earlier = [pod(0, "Failed", exit_code=1, log="rank 0: bad batch", finished="2026-01-01T00:00:01Z"), same_time[1]]
    plan, _ = reconcile(r, earlier, T0)
    assert "r-trainer-0 failed" in find(plan.status["conditions"], "Failed")["message"]


def test_past_max_restarts_the_run_fails_with_the_failing_pods_last_log_lines():
    r = run(status={"phase": "Running", "trainer": {"restarts": 1, "failures": 1}}, max_restarts=1)
    group = [pod(0, "Running", incarnation=1), pod(1, "Failed", incarnation=1, exit_code=1,
                                                   log="Traceback ...\nRuntimeError: boom")]
    plan, _ = reconcile(r, group, T0)
    failed = find(plan.status["conditions"], "Failed")
    assert plan.status["phase"] == "Failed" and "RuntimeError: boom" in failed["message"]
    assert "maxRestarts 1" in failed["message"] and "fails as one" in failed["message"]
    assert created(plan) == [] and plan.delete == []


def test_a_pod_of_the_group_that_vanished_while_running_is_a_lost_trainer():
    r = run(status={"phase": "Running"})
    plan, r = reconcile(r, [pod(0, "Running")], T0)
    last = plan.status["trainer"]["lastFailure"]
    assert last["reason"] == "TrainerLost" and "r-trainer-1" in last["message"] and created(plan) == []
    due, _ = reconcile(r, [pod(0, "Running")], T0 + backoff_s(0) + 1)
    assert due.delete == [("r-trainer-0", "u0-0")]


def test_the_run_succeeds_when_pod_0_rank_0s_pod_has_finished():
    r = run(status={"phase": "Running"})
    plan, _ = reconcile(r, [pod(0, "Succeeded", exit_code=0), pod(1, "Running")], T0)
    assert plan.status["phase"] == "Succeeded" and created(plan) == [] and plan.delete == []
    late, _ = reconcile(r, [pod(0, "Succeeded", exit_code=0), pod(1, "Failed", exit_code=1)], T0)
    assert late.status["phase"] == "Succeeded" and late.status["trainer"]["failures"] == 0


class Answers:
    """Reads of pods answered from a script, in order: a pod, or an ApiError raised (no API server: the
    retry rule of `find_place` is what is tested)."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.reads: list[str] = []

    async def get(self, resource, name, namespace):
        self.reads.append(name)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def trainer_pod(node: int, ip: str | None = None) -> dict:
    return {"metadata": {"name": f"r-trainer-{node}", "annotations": {b.ANN_RESTARTS: "0"}},
            "status": {"podIP": ip} if ip else {}}


@pytest.mark.looptime
async def test_pod_1_finds_pod_0_through_passing_api_server_errors_and_fails_on_the_others():
    from rlfleet.kube.client import ApiError
    from rlfleet.orchestrator.run.trainer_group import find_place

    env = {"RLFLEET_TRAINER_NODE": "1", "POD_NAME": "r-trainer-1"}
    kube = Answers(ApiError(0, "no answer"), trainer_pod(1), ApiError(503, "Service Unavailable"),
                   ApiError(429, "Too Many Requests"), trainer_pod(0),
                   trainer_pod(0, "10.0.0.7"))
    place = await find_place(kube, "ns", "r", 2, timeout_s=60, env=env)  # type: ignore[arg-type]
    assert place.rendezvous == ("10.0.0.7", 29500) and place.node_rank == 1
    assert kube.reads == ["r-trainer-1", "r-trainer-1", "r-trainer-0", "r-trainer-0", "r-trainer-0",
                          "r-trainer-0"]

    forbidden = Answers(trainer_pod(1), ApiError(403, "Forbidden", "cannot get pods"))
    with pytest.raises(ApiError, match="403"):
        await find_place(forbidden, "ns", "r", 2, timeout_s=60, env=env)  # type: ignore[arg-type]

    with pytest.raises(TimeoutError, match=r"could not read this pod \(r-trainer-1\) within 5 s: the API server "
                                           r"answered 500"):
        await find_place(Answers(*[ApiError(500, "Internal Server Error")] * 10), "ns", "r", 2, timeout_s=5,
                         env=env)  # type: ignore[arg-type]
