"""A fleet's child objects, end to end: the engine NetworkPolicy (created, owned, exact, restored, switched
off, collected) and the router Deployment (rolled when the fleet's router spec changes); a broadcast
run's update-group NetworkPolicies (restored after an edit, deleted when the run leaves broadcast mode
or the operator's policies are switched off, created again when wanted again).

Real kube-apiserver + etcd + kube-controller-manager (`control_plane`, whose API server validates the
policy's schema), the chart installed with helm, the operator as a local process with the chart's
ServiceAccount token. No node agent: engine, router and trainer pods are created but never run (no SGLang).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from helpers.cluster import (
    OPERATOR_SA,
    SYSTEM_NS,
    OperatorProcess,
    apply,
    chart_installed,
    fleet_api_key,
    get_json,
    wait_for,
)
from rlfleet.operator import builders as b

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-netpol"
RUN_FLEET, RUN = "np-run-rollout", "np-run"  # the rollout fleet the run np-run creates
SOLO_FLEET = "np-solo"
LABELLED_FLEET = "np-labelled"  # names np-run in runName, but no run created it: a fleet of no run
ENGINE_PORT = 31000
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
PROMETHEUS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
               "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


@pytest.fixture(scope="module")
def installed(control_plane):
    with chart_installed(control_plane, NS):
        yield


@pytest.fixture(scope="module")
def operator_kubeconfig(control_plane, installed):
    return control_plane.service_account_kubeconfig(SYSTEM_NS, OPERATOR_SA)


@pytest.fixture(scope="module")
def operator(operator_kubeconfig, tmp_path_factory):
    op = OperatorProcess(operator_kubeconfig, NS, tmp_path_factory.mktemp("operator"),
                         extra_args=("--network-policy-metrics-from", json.dumps(PROMETHEUS)))
    op.start()
    yield op
    op.stop()


def fleet_manifest(name: str, *, run_name: str | None) -> dict:
    # One slot: its pod is created but, with no node agent, never scheduled nor run.
    spec = {"replicas": 1, "minReadyEngines": 1,
            "engine": {"modelPath": "/models/none", "device": "cpu", "port": ENGINE_PORT},
            "health": {"startupTimeoutSeconds": 3600}}
    if run_name:
        spec["runName"] = run_name
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def run_of_one_engine(name: str) -> dict:
    """The quickstart as a run of one rollout engine on ENGINE_PORT and no eval fleet; its pods never run."""
    run = yaml.safe_load(QUICKSTART.read_text())
    run["metadata"] = {"name": name, "namespace": NS}
    run["spec"]["rollout"].update(replicas=1, minReadyEngines=1)
    run["spec"]["rollout"]["engine"]["port"] = ENGINE_PORT
    run["spec"]["rollout"]["health"]["startupTimeoutSeconds"] = 3600
    del run["spec"]["eval"]
    return run


@pytest.fixture(scope="module")
def fleets(control_plane, operator):
    """The rollout fleet of a run (created by the operator), a fleet of no run, and a fleet of no run that
    names the run in runName."""
    cp = control_plane
    apply(cp, [run_of_one_engine(RUN), fleet_manifest(SOLO_FLEET, run_name=None),
               fleet_manifest(LABELLED_FLEET, run_name=RUN)])
    wait_for(lambda: get_json(cp, "rolloutfleet", RUN_FLEET, namespace=NS), timeout=60, interval=0.5,
             what=f"the run's fleet {RUN_FLEET}", context=operator.tail)
    yield {name: get_json(cp, "rolloutfleet", name, namespace=NS) for name in (RUN_FLEET, SOLO_FLEET, LABELLED_FLEET)}
    cp.kubectl("delete", "trainingrun", RUN, "-n", NS, "--ignore-not-found", "--wait=false", check=False)
    for name in (SOLO_FLEET, LABELLED_FLEET):
        cp.kubectl("delete", "rolloutfleet", name, "-n", NS, "--ignore-not-found", "--wait=false", check=False)


BROADCAST_RUN = "np-bcast"
UPDATE_GROUP_POLICIES = (f"{BROADCAST_RUN}-trainer", f"{BROADCAST_RUN}-update-group")


@pytest.fixture(scope="module")
def broadcast_run(control_plane, operator):
    """A run in broadcast mode, of one rollout engine and no eval fleet; its pods never run."""
    cp = control_plane
    run = yaml.safe_load(QUICKSTART.read_text())
    run["metadata"] = {"name": BROADCAST_RUN, "namespace": NS}
    run["spec"]["rollout"].update(replicas=1, minReadyEngines=1)
    run["spec"]["weightSync"] = {"mode": "broadcast"}
    del run["spec"]["eval"]
    apply(cp, run)
    yield get_json(cp, "trainingrun", BROADCAST_RUN, namespace=NS)
    cp.kubectl("delete", "trainingrun", BROADCAST_RUN, "-n", NS, "--ignore-not-found", "--wait=false", check=False)


def update_group_policies(cp) -> dict[str, dict]:
    found = {name: get_json(cp, "networkpolicy", name, namespace=NS) for name in UPDATE_GROUP_POLICIES}
    return {name: pol for name, pol in found.items() if pol is not None}


def wait_update_group_policies(cp, op: OperatorProcess, *, not_uids: set[str] = frozenset()) -> dict[str, dict]:
    return wait_for(lambda: len(pols := update_group_policies(cp)) == 2
                    and not {p["metadata"]["uid"] for p in pols.values()} & not_uids and pols,
                    timeout=60, interval=0.5, what="the update group's NetworkPolicies", context=op.tail)


def policy(cp, fleet: str) -> dict | None:
    return get_json(cp, "networkpolicy", b.network_policy_name(fleet), namespace=NS)


def wait_policy(cp, fleet: str, op: OperatorProcess, *, not_uid: str | None = None) -> dict:
    return wait_for(lambda: (p := policy(cp, fleet)) and p["metadata"]["uid"] != not_uid and p, timeout=60,
                    interval=0.5, what=f"NetworkPolicy {b.network_policy_name(fleet)}", context=op.tail)


def event_reasons(cp, name: str) -> set[str]:
    events = get_json(cp, "events", "--field-selector", f"involvedObject.name={name}", namespace=NS) or {}
    return {e["reason"] for e in events.get("items", [])}


def pods_selected(cp, selector: dict) -> set[str]:
    labels = ",".join(f"{k}={v}" for k, v in selector["matchLabels"].items())
    return {p["metadata"]["name"] for p in (get_json(cp, "pods", "-l", labels, namespace=NS) or {}).get("items", [])}


def test_each_fleet_gets_an_owned_policy_admitting_only_its_router_and_trainer(control_plane, operator, fleets):
    cp = control_plane
    http = [{"port": ENGINE_PORT, "protocol": "TCP"}]
    for name, fleet in fleets.items():
        pol = wait_policy(cp, name, operator)
        owner = pol["metadata"]["ownerReferences"]
        assert owner == [{"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet", "name": name,
                          "uid": fleet["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        spec = pol["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        # It selects exactly the fleet's engine pod, and its router peer exactly the fleet's router pod(s).
        wait_for(lambda spec=spec, name=name: pods_selected(cp, spec["podSelector"]) == {f"{name}-engine-0"},
                 timeout=60,
                 what=f"{name}'s engine pod", context=operator.tail)
        router_peer = spec["ingress"][0]
        routers = wait_for(lambda peer=router_peer: pods_selected(cp, peer["from"][0]["podSelector"]), timeout=60,
                           what=f"{name}'s router pod")
        assert all(r.startswith(f"{name}-router-") for r in routers), routers
        assert router_peer == {"from": [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/component": "router", "rlfleet.io/fleet": name}}}], "ports": http}
        # The API server returns what the builder makes: the operator never patches it for nothing.
        assert spec == b.build_engine_network_policy(fleet, metrics_from=PROMETHEUS)["spec"]
        assert spec["ingress"][2] == {"from": PROMETHEUS, "ports": http}
        assert len(spec["ingress"]) == 3

    run_rules = policy(cp, RUN_FLEET)["spec"]["ingress"]
    assert run_rules[1] == {"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/component": "trainer", "rlfleet.io/run": RUN}}}]}
    for solo in (SOLO_FLEET, LABELLED_FLEET):  # runName alone does not make a fleet the run's
        solo_rules = policy(cp, solo)["spec"]["ingress"]
        assert solo_rules[1] == {"from": [{"podSelector": {"matchLabels": {"rlfleet.io/client": "true"}}}],
                                 "ports": http}
    wait_for(lambda: "NetworkPolicyCreated" in event_reasons(cp, SOLO_FLEET), timeout=30, interval=0.5,
             what="the NetworkPolicyCreated Event")
    # The fleet that names a run which did not create it is told so (once), the one of no runName is not.
    wait_for(lambda: "RunNameNotOwned" in event_reasons(cp, LABELLED_FLEET), timeout=30, interval=0.5,
             what="the RunNameNotOwned Event")
    assert "RunNameNotOwned" not in event_reasons(cp, SOLO_FLEET) | event_reasons(cp, RUN_FLEET)


def test_each_router_admits_only_its_trainer_and_a_fleet_of_no_run_holds_its_own_key(control_plane, operator,
                                                                                   fleets):
    cp = control_plane
    for name, fleet in fleets.items():
        pol = wait_for(lambda name=name: get_json(cp, "networkpolicy", b.router_network_policy_name(name),
                                                  namespace=NS), timeout=60, interval=0.5,
                       what=f"{name}'s router NetworkPolicy", context=operator.tail)
        assert pol["metadata"]["ownerReferences"][0]["uid"] == fleet["metadata"]["uid"]
        assert pol["spec"] == b.build_router_network_policy(fleet, metrics_from=PROMETHEUS)["spec"]
        routers = wait_for(lambda pol=pol: pods_selected(cp, pol["spec"]["podSelector"]), timeout=60,
                           what=f"{name}'s router pod")
        assert all(r.startswith(f"{name}-router-") for r in routers), routers
        assert pods_selected(cp, pol["spec"]["podSelector"]).isdisjoint({f"{name}-engine-0"})
    assert policy_from(cp, RUN_FLEET) == {"app.kubernetes.io/component": "trainer", "rlfleet.io/run": RUN}
    assert policy_from(cp, SOLO_FLEET) == policy_from(cp, LABELLED_FLEET) == {"rlfleet.io/client": "true"}

    # A fleet of no run (runName or not): its own Secret, owned by it, immutable; its engine and router read it.
    for solo in (SOLO_FLEET, LABELLED_FLEET):
        secret = wait_for(lambda solo=solo: get_json(cp, "secret", b.api_key_secret_name(solo), namespace=NS),
                          timeout=60, interval=0.5, what=f"{solo}'s API key Secret", context=operator.tail)
        assert secret["metadata"]["ownerReferences"][0]["uid"] == fleets[solo]["metadata"]["uid"]
        assert secret["immutable"] is True
        assert len(fleet_api_key(cp, solo, NS)) == 64
        pod = get_json(cp, "pod", f"{solo}-engine-0", namespace=NS)
        key_env = next(e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "RLFLEET_API_KEY")
        assert key_env["valueFrom"]["secretKeyRef"]["name"] == b.api_key_secret_name(solo)
    # A run's fleet gets its key from the run.
    run_key = get_json(cp, "secret", b.api_key_secret_name(RUN_FLEET), namespace=NS)
    assert run_key["metadata"]["ownerReferences"][0]["kind"] == "TrainingRun"
    assert run_key["metadata"]["ownerReferences"][0]["name"] == RUN


def test_a_run_creates_one_key_for_its_fleets_before_them_and_its_trainer_reads_it(control_plane, operator):
    cp = control_plane
    name = "np-keyed"
    run = yaml.safe_load(QUICKSTART.read_text())  # its eval posture is fleet: two fleets
    run["metadata"] = {"name": name, "namespace": NS}
    apply(cp, run)
    try:
        uid = get_json(cp, "trainingrun", name, namespace=NS)["metadata"]["uid"]
        fleets = (f"{name}-rollout", f"{name}-eval")
        secrets = [wait_for(lambda f=f: get_json(cp, "secret", b.api_key_secret_name(f), namespace=NS), timeout=60,
                            interval=0.5, what=f"the Secret of {f}", context=operator.tail) for f in fleets]
        assert [s["metadata"]["ownerReferences"][0]["uid"] for s in secrets] == [uid, uid]
        keys = {fleet_api_key(cp, f, NS) for f in fleets}
        assert len(keys) == 1 and len(keys.pop()) == 64  # one key: the trainer holds one
        trainer = wait_for(lambda: get_json(cp, "pod", f"{name}-trainer", namespace=NS), timeout=60, interval=0.5,
                           what="the trainer pod", context=operator.tail)
        key_env = next(e for e in trainer["spec"]["containers"][0]["env"] if e["name"] == "RLFLEET_API_KEY")
        assert key_env["valueFrom"]["secretKeyRef"]["name"] == b.api_key_secret_name(f"{name}-rollout")
        # Created before the fleets and the trainer: none of them ever waited for a missing Secret.
        created = {s["metadata"]["name"]: s["metadata"]["creationTimestamp"] for s in secrets}
        for kind, obj in (("rolloutfleet", fleets[0]), ("evalfleet", fleets[1]), ("pod", f"{name}-trainer")):
            stamp = get_json(cp, kind, obj, namespace=NS)["metadata"]["creationTimestamp"]
            assert all(stamp >= c for c in created.values()), (obj, stamp, created)
    finally:
        cp.kubectl("delete", "trainingrun", name, "-n", NS, "--ignore-not-found", "--wait=false", check=False)


def policy_from(cp, fleet: str) -> dict:
    pol = get_json(cp, "networkpolicy", b.router_network_policy_name(fleet), namespace=NS)
    return pol["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]


def test_a_deleted_or_loosened_policy_is_restored(control_plane, operator, fleets):
    cp = control_plane
    old = wait_policy(cp, SOLO_FLEET, operator)
    cp.kubectl("delete", "networkpolicy", b.network_policy_name(SOLO_FLEET), "-n", NS)
    new = wait_policy(cp, SOLO_FLEET, operator, not_uid=old["metadata"]["uid"])
    assert new["spec"] == old["spec"]

    # Someone opens the engines to the whole namespace: the operator puts the policy back.
    cp.kubectl("patch", "networkpolicy", b.network_policy_name(SOLO_FLEET), "-n", NS, "--type", "merge",
               "-p", json.dumps({"spec": {"ingress": [{}]}}))
    wait_for(lambda: policy(cp, SOLO_FLEET)["spec"] == old["spec"], timeout=60, interval=0.5,
             what="the loosened policy to be restored", context=operator.tail)
    wait_for(lambda: "NetworkPolicyRestored" in event_reasons(cp, SOLO_FLEET), timeout=30, interval=0.5,
             what="the NetworkPolicyRestored Event")


def test_a_broadcast_runs_update_group_policies_are_restored_and_follow_its_mode(control_plane, operator,
                                                                                 broadcast_run):
    cp = control_plane
    pols = wait_update_group_policies(cp, operator)
    built = {p["metadata"]["name"]: p for p in b.build_trainer_network_policies(broadcast_run)}
    for name, pol in pols.items():
        assert pol["metadata"]["ownerReferences"][0]["uid"] == broadcast_run["metadata"]["uid"]
        assert pol["spec"] == built[name]["spec"]  # as built: the operator never patches it for nothing
    generations = {name: pol["metadata"]["generation"] for name, pol in pols.items()}

    # Deleted by hand: created again. Opened to everyone (and given egress rules): put back as built.
    trainer_name, group_name = UPDATE_GROUP_POLICIES
    cp.kubectl("delete", "networkpolicy", trainer_name, "-n", NS)
    cp.kubectl("patch", "networkpolicy", group_name, "-n", NS, "--type", "merge",
               "-p", json.dumps({"spec": {"ingress": [{}], "policyTypes": ["Ingress", "Egress"], "egress": [{}]}}))
    wait_for(lambda: update_group_policies(cp).get(trainer_name, {}).get("metadata", {}).get("uid")
             not in (None, pols[trainer_name]["metadata"]["uid"]), timeout=60, interval=0.5,
             what=f"{trainer_name} created again", context=operator.tail)
    wait_for(lambda: (get_json(cp, "networkpolicy", group_name, namespace=NS) or {}).get("spec")
             == built[group_name]["spec"], timeout=60, interval=0.5, what=f"{group_name} restored",
             context=operator.tail)
    wait_for(lambda: {"NetworkPolicyCreated", "NetworkPolicyRestored"} <= event_reasons(cp, BROADCAST_RUN),
             timeout=30, interval=0.5, what="the run's NetworkPolicy Events")
    restored = get_json(cp, "networkpolicy", group_name, namespace=NS)["metadata"]["generation"]
    assert restored == generations[group_name] + 2  # the edit and the one patch back
    time.sleep(3)  # a few more passes of the operator change nothing
    assert get_json(cp, "networkpolicy", group_name, namespace=NS)["metadata"]["generation"] == restored

    # The run's weight sync is fixed once it exists: leaving broadcast mode is refused, the policies stay.
    refused = cp.kubectl("patch", "trainingrun", BROADCAST_RUN, "-n", NS, "--type", "merge",
                         "-p", json.dumps({"spec": {"weightSync": {"mode": "disk"}}}), check=False)
    assert refused.returncode != 0 and "spec.weightSync" in refused.stderr, refused.stderr
    assert set(update_group_policies(cp)) == set(UPDATE_GROUP_POLICIES)


def test_switched_off_the_operator_deletes_its_policies_and_back_on_recreates_them(
        control_plane, operator, operator_kubeconfig, fleets, broadcast_run, tmp_path):
    cp = control_plane
    before = {name: wait_policy(cp, name, operator)["metadata"]["uid"] for name in fleets}
    run_before = {p["metadata"]["uid"] for p in wait_update_group_policies(cp, operator).values()}
    operator.stop()
    off = OperatorProcess(operator_kubeconfig, NS, tmp_path, extra_args=("--no-network-policy",))
    off.start()
    try:
        wait_for(lambda: all(policy(cp, name) is None for name in fleets) and update_group_policies(cp) == {},
                 timeout=60, interval=0.5, what="the policies to be deleted when switched off", context=off.tail)
    finally:
        off.stop()
    operator.start()
    for name in fleets:
        assert wait_policy(cp, name, operator)["metadata"]["uid"] != before[name]
    wait_update_group_policies(cp, operator, not_uids=run_before)


def test_a_changed_router_spec_rolls_the_router_deployment(control_plane, operator, fleets):
    cp = control_plane
    name = b.router_name(SOLO_FLEET)

    def router_command() -> list[str]:
        deployment = get_json(cp, "deployment", name, namespace=NS) or {}
        containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])
        return containers[0].get("command", [])

    wait_for(lambda: "cache_aware" in router_command(), timeout=60, interval=0.5, what="the router Deployment",
             context=operator.tail)
    generation = get_json(cp, "deployment", name, namespace=NS)["metadata"]["generation"]
    cp.kubectl("patch", "rolloutfleet", SOLO_FLEET, "-n", NS, "--type=merge",
               "-p", json.dumps({"spec": {"router": {"policy": "round_robin"}}}))
    wait_for(lambda: "round_robin" in router_command(), timeout=60, interval=0.5,
             what="the router Deployment to take the new policy", context=operator.tail)
    deployment = get_json(cp, "deployment", name, namespace=NS)
    assert deployment["metadata"]["generation"] == generation + 1  # one rollout, no patch storm
    assert "RouterUpdated" in event_reasons(cp, SOLO_FLEET)
    time.sleep(3)  # a few more passes of the operator change nothing
    assert get_json(cp, "deployment", name, namespace=NS)["metadata"]["generation"] == generation + 1


def test_deleting_a_fleet_garbage_collects_its_policy(control_plane, operator, fleets):
    cp = control_plane
    for name in fleets:
        wait_policy(cp, name, operator)
        if name == RUN_FLEET:  # the run would create its fleet again: the run goes, and its fleet with it
            cp.kubectl("delete", "trainingrun", RUN, "-n", NS, "--wait=false")
        else:
            cp.kubectl("delete", "rolloutfleet", name, "-n", NS, "--wait=false")
    wait_for(lambda: all(policy(cp, name) is None for name in fleets), timeout=120, interval=1,
             what="garbage collection of the fleets' policies",
             context=lambda: cp.kubectl("get", "networkpolicies,rolloutfleets", "-n", NS, check=False).stdout)
