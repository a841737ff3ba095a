"""Children are the owner's by ownerReference UID, and a child the API server refuses is shown at once.

Real kube-apiserver + etcd + kube-controller-manager (`control_plane`: its admission plugins, LimitRanger
included, and the ReplicaSet controller that makes the router's pods), the chart installed with helm,
the operator as a local process with the chart's ServiceAccount token, the trainer's view with the
trainer's token. No node agent: pods are created but never run; a pod's status is written the way a
kubelet would (status subresource) where a test needs a Ready pod.
"""
from __future__ import annotations

import json
import time

import pytest

from helpers.cluster import (
    apply,
    chart_installed,
    chart_operator,
    get_json,
    wait_for,
)
from rlfleet.operator import builders as b

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-owners"
RUN = "own-run"
FLEET = b.rollout_fleet_name(RUN)
ROUTER_PORT = 30000


@pytest.fixture(scope="module")
def installed(control_plane):
    with chart_installed(control_plane, NS):
        yield


@pytest.fixture(scope="module")
def operator(control_plane, installed, tmp_path_factory):
    with chart_operator(control_plane, NS, tmp_path_factory.mktemp("operator")) as op:
        yield op


def pod(name: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "registry.invalid/decoy:1"}]}}


def make_ready(cp, name: str, ip: str) -> None:
    """Write the status a kubelet would: Running, Ready, with an address."""
    status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
              "conditions": [{"type": "Ready", "status": "True"}]}
    cp.kubectl("patch", "pod", name, "-n", NS, "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": status}))


def run_manifest(name: str, **trainer) -> dict:
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun", "metadata": {"name": name, "namespace": NS},
            "spec": {"modelPath": "/models/none", "trainer": {"gpus": 0, **trainer},
                     "rollout": {"replicas": 2, "minReadyEngines": 1, "engine": {"device": "cpu"},
                                 "health": {"startupTimeoutSeconds": 3600}},
                     "weightSync": {"snapshotVolume": {"size": "1Gi"}}}}


def events(cp, name: str) -> list[dict]:
    found = get_json(cp, "events", "--field-selector", f"involvedObject.name={name}", namespace=NS) or {}
    return found.get("items", [])


def reasons_of(cp, name: str) -> list[str]:
    return [e["reason"] for e in events(cp, name)]


def cond(obj: dict | None, kind: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions", []) if c["type"] == kind), {})


@pytest.fixture(scope="module")
def decoys(control_plane, operator):
    """Before the run exists: a fleet with its runName, a Running pod labelled as its trainer, a Ready pod
    with its fleet's router labels, one with its engine labels, and one squatting its slot 1's name."""
    cp = control_plane
    decoy_fleet = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
                   "metadata": {"name": "decoy-fleet", "namespace": NS},
                   "spec": {"runName": RUN, "replicas": 0, "engine": {"modelPath": "/models/decoy", "device": "cpu"}}}
    squatter = b.engine_pod_name(FLEET, 1)
    apply(cp, [decoy_fleet, pod("decoy-trainer", b.run_labels(RUN, "trainer")),
               pod("decoy-router", b.router_labels(FLEET)), pod("decoy-engine", b.engine_labels(FLEET, 0)),
               pod(squatter, b.engine_labels(FLEET, 1))])
    make_ready(cp, "decoy-trainer", "10.66.0.1")
    make_ready(cp, "decoy-router", "10.66.0.2")
    make_ready(cp, "decoy-engine", "10.66.0.3")
    make_ready(cp, squatter, "10.66.0.4")
    before = get_json(cp, "rolloutfleet", "decoy-fleet", namespace=NS)
    apply(cp, run_manifest(RUN))
    run = wait_for(lambda: get_json(cp, "trainingrun", RUN, namespace=NS), timeout=30, what="the run")
    yield {"fleet": before, "run": run, "squatter": squatter}
    cp.kubectl("delete", "trainingrun", RUN, "-n", NS, "--wait=false", check=False)
    cp.kubectl("delete", "rolloutfleet", "decoy-fleet", "-n", NS, "--wait=false", check=False)
    cp.kubectl("delete", "pods", "decoy-trainer", "decoy-router", "decoy-engine", squatter, "-n", NS,
               "--ignore-not-found", "--wait=false", check=False)


def test_decoys_are_ignored_reported_and_left_alone(control_plane, operator, decoys):
    cp = control_plane
    run_uid = decoys["run"]["metadata"]["uid"]
    # The run makes its own fleet and trainer: neither the decoy fleet nor the decoy trainer stands in.
    fleet = wait_for(lambda: get_json(cp, "rolloutfleet", FLEET, namespace=NS), timeout=60, interval=0.5,
                     what=f"the run's own {FLEET}", context=operator.tail)
    assert fleet["metadata"]["ownerReferences"][0]["uid"] == run_uid
    trainer = wait_for(lambda: get_json(cp, "pod", b.trainer_pod_name(RUN), namespace=NS), timeout=60,
                       interval=0.5, what="the run's own trainer pod", context=operator.tail)
    assert trainer["metadata"]["ownerReferences"][0]["uid"] == run_uid
    wait_for(lambda: get_json(cp, "pod", b.engine_pod_name(FLEET, 0), namespace=NS), timeout=60, interval=0.5,
             what="the fleet's engine pod of slot 0", context=operator.tail)
    # Each decoy is reported once, by a Warning Event on the owner it pretends to belong to.
    wait_for(lambda: reasons_of(cp, RUN).count("ForeignChildIgnored") == 2, timeout=60, interval=0.5,
             what="ForeignChildIgnored Events on the run (decoy fleet, decoy trainer)", context=operator.tail)
    wait_for(lambda: reasons_of(cp, FLEET).count("ForeignChildIgnored") >= 2, timeout=60, interval=0.5,
             what="ForeignChildIgnored Events on the fleet (decoy engine, squatter)", context=operator.tail)
    messages = " ".join(e["message"] for e in events(cp, RUN) + events(cp, FLEET)
                        if e["reason"] == "ForeignChildIgnored")
    assert "RolloutFleet decoy-fleet" in messages and "Pod decoy-trainer" in messages
    assert "Pod decoy-engine" in messages and f"Pod {decoys['squatter']}" in messages

    # The slot whose name is taken: ChildRejected on the fleet (Degraded, retried), the squatter untouched.
    degraded = wait_for(lambda: (c := cond(get_json(cp, "rolloutfleet", FLEET, namespace=NS), "Degraded"))
                        .get("reason") == "ChildRejected" and c, timeout=60, interval=0.5,
                        what="Degraded ChildRejected on the fleet", context=operator.tail)
    assert f"a Pod named {decoys['squatter']} already exists and is not owned by RolloutFleet {FLEET}" \
        in degraded["message"]
    assert "ChildRejected" in reasons_of(cp, FLEET)

    time.sleep(3)  # a few more passes of the operator: still nothing adopted, deleted or patched
    after = get_json(cp, "rolloutfleet", "decoy-fleet", namespace=NS)
    assert after["spec"] == decoys["fleet"]["spec"] and "ownerReferences" not in after["metadata"]
    for name in ("decoy-trainer", "decoy-router", "decoy-engine", decoys["squatter"]):
        left = get_json(cp, "pod", name, namespace=NS)
        assert left is not None and not left["metadata"].get("deletionTimestamp"), name
        assert "ownerReferences" not in left["metadata"], name
    assert (get_json(cp, "trainingrun", RUN, namespace=NS)["status"]["phase"]) == "Pending"  # no decoy trainer
    assert reasons_of(cp, RUN).count("ForeignChildIgnored") == 2  # once each, not once per pass


async def test_the_trainer_sees_only_the_fleets_own_router_and_engine_pods(control_plane, operator, decoys):
    import asyncio

    from rlfleet.kube.client import KubeClient
    from rlfleet.orchestrator.fleet.k8s_backend import KubernetesBackend, attach_fleet, router_address

    cp = control_plane
    fleet = await asyncio.to_thread(wait_for, lambda: get_json(cp, "rolloutfleet", FLEET, namespace=NS),
                                    timeout=60, what=FLEET)
    fleet_uid = fleet["metadata"]["uid"]
    kube = await KubeClient.load(await asyncio.to_thread(cp.service_account_kubeconfig, NS, "rlfleet-trainer"))
    try:
        # A Ready pod with the router's labels is not the router: no URL until the real one is Ready.
        assert await router_address(kube, NS, FLEET, ROUTER_PORT, fleet_uid=fleet_uid) is None
        real = await asyncio.to_thread(wait_for, lambda: [
            p["metadata"]["name"] for p in (get_json(cp, "pods", "-l", f"rlfleet.io/fleet={FLEET},"
                                                     "app.kubernetes.io/component=router", namespace=NS)
                                            or {}).get("items", []) if p["metadata"]["name"] != "decoy-router"],
            timeout=60, what="the router Deployment's pod")
        await asyncio.to_thread(make_ready, cp, real[0], "10.66.1.1")
        router = await router_address(kube, NS, FLEET, ROUTER_PORT, fleet_uid=fleet_uid)
        assert router is not None and router.url == f"http://10.66.1.1:{ROUTER_PORT}"
        # The decoy fleet has the run's runName, but attaching goes by the run's ownership.
        with pytest.raises(Exception, match="not the run's"):
            await attach_fleet(kube, NS, "decoy-fleet", timeout=1, owner_uid=decoys["run"]["metadata"]["uid"])

        # The engines: slot 1's name is squatted by a Ready pod; the backend does not take it for the slot.
        await asyncio.to_thread(make_ready, cp, b.engine_pod_name(FLEET, 0), "10.66.1.2")
        backend = await KubernetesBackend.connect(kube, namespace=NS, fleet=FLEET)
        await backend.start()
        try:
            engines = backend.engines()
            assert engines[0].url == "http://10.66.1.2:30000"
            assert engines[1].url is None and engines[1].pod is None
        finally:
            await backend.stop()
    finally:
        await kube.close()


def test_a_squatted_name_freed_is_created_and_the_condition_clears(control_plane, operator, decoys):
    cp = control_plane
    cp.kubectl("delete", "pod", decoys["squatter"], "-n", NS, "--wait=true")
    run_uid = wait_for(lambda: get_json(cp, "rolloutfleet", FLEET, namespace=NS), timeout=10,
                       what=FLEET)["metadata"]["uid"]
    created = wait_for(lambda: (p := get_json(cp, "pod", decoys["squatter"], namespace=NS)) and p, timeout=90,
                       interval=0.5, what="the slot's own pod once the name is free", context=operator.tail)
    assert created["metadata"]["ownerReferences"][0]["uid"] == run_uid
    wait_for(lambda: cond(get_json(cp, "rolloutfleet", FLEET, namespace=NS), "Degraded").get("reason")
             != "ChildRejected", timeout=60, interval=0.5, what="the ChildRejected condition to clear")


LIMIT_RANGE = {"apiVersion": "v1", "kind": "LimitRange", "metadata": {"name": "max-cpu", "namespace": NS},
               "spec": {"limits": [{"type": "Container", "max": {"cpu": "1"}}]}}
REFUSED = "maximum cpu usage per Container is 1, but limit is 2"


@pytest.fixture(scope="module")
def limit_range(control_plane, operator):
    apply(control_plane, LIMIT_RANGE)
    yield
    control_plane.kubectl("delete", "limitrange", "max-cpu", "-n", NS, "--ignore-not-found", check=False)


def test_a_refused_trainer_pod_fails_the_run_with_the_servers_message(control_plane, operator, limit_range):
    cp = control_plane
    name = "refused-run"
    apply(cp, run_manifest(name, resources={"limits": {"cpu": "2"}}))
    try:
        run = wait_for(lambda: (r := get_json(cp, "trainingrun", name, namespace=NS))
                       and (r.get("status") or {}).get("phase") == "Failed" and r, timeout=60, interval=0.5,
                       what="the run to fail", context=operator.tail)
        failed = cond(run, "Failed")
        assert failed["status"] == "True" and failed["reason"] == "ChildRejected"
        assert f"the API server refused Pod {b.trainer_pod_name(name)}" in failed["message"]
        assert REFUSED in failed["message"] and REFUSED in run["status"]["message"]
        warning = wait_for(lambda: [e for e in events(cp, name) if e["reason"] == "ChildRejected"], timeout=30,
                           interval=0.5, what="the ChildRejected Event")
        assert warning[0]["type"] == "Warning" and REFUSED in warning[0]["message"]
        assert get_json(cp, "pod", b.trainer_pod_name(name), namespace=NS) is None
        time.sleep(3)  # more passes: no retry, no second Event, still Failed
        assert reasons_of(cp, name).count("ChildRejected") == 1
        assert get_json(cp, "trainingrun", name, namespace=NS)["status"]["phase"] == "Failed"
    finally:
        cp.kubectl("delete", "trainingrun", name, "-n", NS, "--wait=false", check=False)


def test_a_refused_engine_pod_fails_the_fleet_until_its_spec_changes(control_plane, operator, limit_range):
    cp = control_plane
    name = "refused-fleet"
    fleet = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet", "metadata": {"name": name, "namespace": NS},
             "spec": {"replicas": 1, "engine": {"modelPath": "/models/none", "device": "cpu",
                                                "resources": {"limits": {"cpu": "2"}}},
                      "health": {"startupTimeoutSeconds": 3600}}}
    apply(cp, fleet)
    try:
        failed = wait_for(lambda: (c := cond(get_json(cp, "rolloutfleet", name, namespace=NS), "Failed"))
                          .get("status") == "True" and c, timeout=60, interval=0.5, what="the fleet to fail",
                          context=operator.tail)
        assert failed["reason"] == "ChildRejected" and REFUSED in failed["message"]
        assert f"Pod {b.engine_pod_name(name, 0)}" in failed["message"]
        wait_for(lambda: "ChildRejected" in reasons_of(cp, name), timeout=30, interval=0.5,
                 what="the ChildRejected Event")
        time.sleep(3)  # held: not created again pass after pass
        assert reasons_of(cp, name).count("ChildRejected") == 1
        assert cond(get_json(cp, "rolloutfleet", name, namespace=NS), "Failed") == failed
        # A spec the server admits: created, and the fleet no longer Failed.
        cp.kubectl("patch", "rolloutfleet", name, "-n", NS, "--type=merge",
                   "-p", json.dumps({"spec": {"engine": {"resources": {"limits": {"cpu": "500m"}}}}}))
        wait_for(lambda: get_json(cp, "pod", b.engine_pod_name(name, 0), namespace=NS), timeout=60, interval=0.5,
                 what="the engine pod once admitted", context=operator.tail)
        wait_for(lambda: cond(get_json(cp, "rolloutfleet", name, namespace=NS), "Failed").get("status") == "False",
                 timeout=60, interval=0.5, what="Failed to clear")
    finally:
        cp.kubectl("delete", "rolloutfleet", name, "-n", NS, "--wait=false", check=False)
