"""The trainer's ServiceAccount cannot take over its namespace, and its marks still work.

Real kube-apiserver + etcd (`control_plane`), the chart installed with helm, the operator as a local
process with the chart's operator token; no node agent, so engine pods stay unscheduled (the API
server deletes those at once) and no engine starts. The trainer's own token (chart RBAC) and a
stranger's (a ServiceAccount with no role) are refused every pod and spec change; the orchestrator's
marks, written with the trainer's token into status only, make the operator recreate a slot from the
pinned snapshot, show read-back versions and fail the run.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from helpers.cluster import (
    apply,
    chart_installed,
    chart_operator,
    get_json,
    wait_for,
)

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-rbac"
FLEET = "rf-marks"
RUN = "run-marks"


@pytest.fixture(scope="module")
def installed(control_plane):
    with chart_installed(control_plane, NS):
        yield


@pytest.fixture(scope="module")
def operator(control_plane, installed, tmp_path_factory):
    with chart_operator(control_plane, NS, tmp_path_factory.mktemp("operator")) as op:
        yield op


@pytest.fixture(scope="module")
def trainer_kubeconfig(control_plane, installed):
    return control_plane.service_account_kubeconfig(NS, "rlfleet-trainer")


@pytest.fixture(scope="module")
def stranger_kubeconfig(control_plane, installed):
    return control_plane.service_account_kubeconfig(NS, "stranger")


def fleet_manifest() -> dict:
    return {
        "apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
        "metadata": {"name": FLEET, "namespace": NS},
        "spec": {
            "replicas": 1, "minReadyEngines": 1,
            "engine": {"modelPath": "/models/launch", "device": "cpu"},
            "snapshots": {"claimName": "marks-snapshots", "mountPath": "/snap"},
            "recovery": {"maxRestartsPerEngine": 3, "maxRestartsPerRun": 10, "backoffBaseSeconds": 0,
                         "backoffMaxSeconds": 1},
        },
    }


def run_manifest() -> dict:
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun", "metadata": {"name": RUN, "namespace": NS},
            "spec": {"modelPath": "tiny://llama?seed=0", "trainer": {"backend": "torch", "gpus": 0, "steps": 2},
                     "rollout": {"replicas": 1, "engine": {"device": "cpu"}}}}


def engine_pod(cp) -> dict | None:
    return get_json(cp, "pod", f"{FLEET}-engine-0", namespace=NS)


def command_arg(pod: dict, flag: str) -> str:
    cmd = pod["spec"]["containers"][0]["command"]
    return cmd[cmd.index(flag) + 1]


def refused(cp, kubeconfig, *args: str) -> str:
    """Run kubectl as that account; it must be refused with 403 Forbidden. Returns the error."""
    result = cp.kubectl(*args, "-n", NS, kubeconfig=kubeconfig, check=False)
    assert result.returncode != 0 and "Forbidden" in result.stderr, (args, result.stdout, result.stderr)
    return result.stderr


def test_trainer_and_stranger_tokens_cannot_change_pods_or_specs(control_plane, operator, trainer_kubeconfig,
                                                                stranger_kubeconfig):
    cp = control_plane
    apply(cp, [fleet_manifest(), run_manifest()])
    pod = wait_for(lambda: engine_pod(cp), timeout=60, interval=0.5, what="the operator's engine pod",
                   context=operator.tail)
    name = pod["metadata"]["name"]
    merge = ["--type=merge", "-p"]
    for account in (trainer_kubeconfig, stranger_kubeconfig):
        refused(cp, account, "patch", "pod", name, *merge, json.dumps({"spec": {"containers": [
            {"name": "engine", "image": "attacker/image"}]}}))
        refused(cp, account, "label", "pod", name, "--overwrite", "app.kubernetes.io/component=router")
        refused(cp, account, "annotate", "pod", name, "rlfleet.io/anything=x")
        refused(cp, account, "delete", "pod", name)
        refused(cp, account, "patch", "rolloutfleet", FLEET, *merge,
                json.dumps({"spec": {"engine": {"image": "attacker/image", "extraArgs": ["--x"]}}}))
        refused(cp, account, "annotate", "rolloutfleet", FLEET, "rlfleet.io/model-path=/etc")
        refused(cp, account, "scale", "rolloutfleet", FLEET, "--replicas=5")
        refused(cp, account, "patch", "trainingrun", RUN, *merge, json.dumps({"spec": {"trainer": {"steps": 9}}}))
        refused(cp, account, "annotate", "trainingrun", RUN, "x=y")
        refused(cp, account, "get", "secrets")
    # The stranger cannot write the marks either.
    refused(cp, stranger_kubeconfig, "patch", "rolloutfleet", FLEET, "--subresource=status", *merge,
            json.dumps({"status": {"orchestrator": {"modelPath": "/snap/x"}}}))
    # Nothing changed.
    after = engine_pod(cp)
    assert after["metadata"]["uid"] == pod["metadata"]["uid"] and after["spec"] == pod["spec"]
    assert get_json(cp, "rolloutfleet", FLEET, namespace=NS)["spec"]["engine"].get("image") != "attacker/image"


async def test_the_trainers_marks_recreate_from_the_pin_show_versions_and_fail_the_run(
        control_plane, operator, trainer_kubeconfig):
    from rlfleet.kube.client import KubeClient
    from rlfleet.orchestrator.fleet.backend import DeathCause, EngineState
    from rlfleet.orchestrator.fleet.k8s_backend import (
        KubernetesBackend,
        fail_run,
        pin_fleet_snapshot,
        report_run_progress,
    )

    cp = control_plane
    await asyncio.to_thread(apply, cp, [fleet_manifest(), run_manifest()])
    first = await asyncio.to_thread(wait_for, lambda: engine_pod(cp), timeout=60, interval=0.5,
                                    what="the engine pod", context=operator.tail)
    assert command_arg(first, "--model-path") == "/models/launch"
    kube = await KubeClient.load(trainer_kubeconfig)
    backend = await KubernetesBackend.connect(kube, namespace=NS, fleet=FLEET)
    try:
        await backend.start()
        await pin_fleet_snapshot(kube, NS, FLEET, model_path="/snap/step_3", weight_version="3")
        assert backend.engines()[0].state is EngineState.STARTING  # unscheduled: never ready
        assert await backend.mark_dead(0, "3 probes timed out", cause=DeathCause.PROBE_FAILED, incarnation=1)

        def replaced():
            pod = engine_pod(cp)
            return pod if pod and pod["metadata"]["uid"] != first["metadata"]["uid"] else None

        second = await asyncio.to_thread(wait_for, replaced, timeout=60, interval=0.5,
                                         what="the operator to recreate the marked slot", context=operator.tail)
        assert command_arg(second, "--model-path") == "/snap/step_3"
        assert command_arg(second, "--weight-version") == "3"
        status = await asyncio.to_thread(lambda: get_json(cp, "rolloutfleet", FLEET, namespace=NS)["status"])
        assert status["restarts"] == 1 and status["engines"][0]["lastFailure"]["reason"] == "ProbeFailed"
        assert status["engines"][0]["lastFailure"]["message"] == "3 probes timed out"
        # The operator's status writes left the trainer's part alone.
        assert status["orchestrator"]["modelPath"] == "/snap/step_3"
        assert status["orchestrator"]["engines"]["0"]["podUID"] == first["metadata"]["uid"]

        for _ in range(100):  # the backend sees the replacement through its watch
            if backend.engines()[0].incarnation == 2:
                break
            await asyncio.sleep(0.1)
        backend.record_weight_version(0, 2, "5")

        def version_shown():
            st = (get_json(cp, "rolloutfleet", FLEET, namespace=NS) or {}).get("status", {})
            return st if (st.get("engines") or [{}])[0].get("weightVersion") == "5" else None

        status = await asyncio.to_thread(wait_for, version_shown, timeout=30, interval=0.3,
                                         what="the read-back version in the fleet status", context=operator.tail)
        assert status["orchestrator"]["engines"]["0"] == {"podUID": second["metadata"]["uid"], "weightVersion": "5"}
        assert replaced()["metadata"]["uid"] == second["metadata"]["uid"]  # a mark of the old pod is not this one's

        # Progress and failure go into the run's status; the operator adopts the failure.
        await report_run_progress(kube, NS, RUN, step=1, weightVersion="1", rewardMean=0.25)
        await fail_run(kube, NS, RUN, reason="RolloutEnginesUnavailable", message="no engine can serve")

        def failed():
            st = (get_json(cp, "trainingrun", RUN, namespace=NS) or {}).get("status", {})
            return st if st.get("phase") == "Failed" else None

        run_status = await asyncio.to_thread(wait_for, failed, timeout=60, interval=0.5,
                                             what="the run to adopt the orchestrator's failure", context=operator.tail)
        cond = next(c for c in run_status["conditions"] if c["type"] == "Failed")
        assert cond["reason"] == "RolloutEnginesUnavailable" and cond["message"] == "no engine can serve"
        assert run_status["step"] == 1 and run_status["rewardMean"] == 0.25
        assert run_status["orchestratorFailure"]["reason"] == "RolloutEnginesUnavailable"
    finally:
        await backend.stop()
        await kube.close()
        await asyncio.to_thread(cp.kubectl, "delete", "trainingrun", RUN, "rolloutfleet", FLEET, "-n", NS,
                                "--wait=false", check=False)
