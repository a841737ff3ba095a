"""The engine NetworkPolicy of a fleet: who may reach the engines, and when the operator writes it."""
import json

import pytest

from rlfleet.operator import builders as b
from rlfleet.operator.fleet_decide import decide_network_policy
from rlfleet.operator.main import parse_args

PROMETHEUS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
               "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def fleet(name="run1-rollout", kind="RolloutFleet", run_name="run1", port=30000, owned=True):
    """A fleet; with `run_name`, one its run created (the run its controller) unless `owned` is False."""
    spec = {"replicas": 2, "engine": {"modelPath": "/models/tiny", "device": "cpu", "port": port}}
    meta: dict = {"name": name, "namespace": "team", "uid": "fleet-uid"}
    if run_name:
        spec["runName"] = run_name
        if owned:
            meta["ownerReferences"] = [{"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun", "name": run_name,
                                        "uid": "run-uid", "controller": True, "blockOwnerDeletion": True}]
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": kind, "metadata": meta, "spec": spec}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def admitted(policy: dict, labels: dict, port: int) -> bool:
    """Whether a pod of this namespace with `labels` may connect to `port` (podSelector peers only)."""
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        if ports and port not in ports:
            continue
        if any("podSelector" in peer and "namespaceSelector" not in peer and selects(peer["podSelector"], labels)
               for peer in rule["from"]):
            return True
    return False


def test_policy_selects_the_fleets_engine_pods_and_is_owned_by_the_fleet():
    f = fleet()
    policy = b.build_engine_network_policy(f)
    meta = policy["metadata"]
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert (meta["name"], meta["namespace"]) == ("run1-rollout-engines", "team")
    assert meta["ownerReferences"] == [{"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
                                        "name": "run1-rollout", "uid": "fleet-uid", "controller": True,
                                        "blockOwnerDeletion": True}]
    assert meta["labels"][b.LABEL_FLEET] == "run1-rollout"
    assert meta["labels"][b.LABEL_MANAGED_BY] == b.MANAGER
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress is not restricted
    selector = policy["spec"]["podSelector"]
    for slot in (0, 1):
        assert selects(selector, b.build_engine_pod(f, slot)["metadata"]["labels"])
    assert not selects(selector, b.build_engine_pod(fleet(name="other"), 0)["metadata"]["labels"])
    assert not selects(selector, b.build_router_deployment(f)["spec"]["template"]["metadata"]["labels"])


def test_only_the_fleets_router_and_its_runs_trainer_reach_the_engines():
    f = fleet(port=31000)
    policy = b.build_engine_network_policy(f)
    router = b.build_router_deployment(f)["spec"]["template"]["metadata"]["labels"]
    trainer = b.build_trainer_pod({"metadata": {"name": "run1", "namespace": "team", "uid": "u"},
                                   "apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
                                   "spec": {"modelPath": "/m"}})["metadata"]["labels"]
    other_router = b.build_router_deployment(fleet(name="x"))["spec"]["template"]["metadata"]["labels"]
    other_trainer = b.run_labels("run2", "trainer")
    assert admitted(policy, router, 31000)
    assert not admitted(policy, router, 22)  # the router needs the HTTP port only
    assert admitted(policy, trainer, 31000)
    assert admitted(policy, trainer, 29500)  # NCCL weight broadcast connects on ports of its own
    assert not admitted(policy, other_router, 31000)
    assert not admitted(policy, other_trainer, 31000)
    assert not admitted(policy, {b.LABEL_CLIENT: "true"}, 31000)  # a run's engines admit no other client
    assert not admitted(policy, b.engine_labels("run1-rollout", 1), 31000)
    assert len(policy["spec"]["ingress"]) == 2  # no metrics peers unless configured


def test_eval_fleet_of_a_run_admits_the_same_trainer():
    policy = b.build_engine_network_policy(fleet(name="run1-eval", kind="EvalFleet"))
    assert policy["metadata"]["ownerReferences"][0]["kind"] == "EvalFleet"
    assert admitted(policy, b.run_labels("run1", "trainer"), 30000)
    assert admitted(policy, b.router_labels("run1-eval"), 30000)
    assert not admitted(policy, b.router_labels("run1-rollout"), 30000)


def test_fleet_of_no_run_admits_labelled_client_pods_on_the_http_port():
    policy = b.build_engine_network_policy(fleet(name="solo", run_name=None))
    assert admitted(policy, {b.LABEL_CLIENT: "true", "app": "notebook"}, 30000)
    assert not admitted(policy, {b.LABEL_CLIENT: "true"}, 29500)
    assert not admitted(policy, {b.LABEL_CLIENT: "false"}, 30000)
    assert not admitted(policy, b.run_labels("solo", "trainer"), 30000)
    assert admitted(policy, b.router_labels("solo"), 30000)


def test_metrics_peers_reach_the_http_port_only():
    policy = b.build_engine_network_policy(fleet(), metrics_from=PROMETHEUS)
    rule = policy["spec"]["ingress"][-1]
    assert rule == {"from": PROMETHEUS, "ports": [{"port": 30000, "protocol": "TCP"}]}


def test_peers_are_validated_and_stored_as_the_api_server_returns_them():
    assert b.network_peers(PROMETHEUS) == PROMETHEUS
    assert b.network_peers([{"namespaceSelector": {"matchLabels": {}}}]) == [{"namespaceSelector": {}}]
    for bad, words in [({"podSelector": {}}, "list"), ([{}], "namespaceSelector and/or podSelector"),
                       ([{"ipBlock": {"cidr": "10.0.0.0/8"}}], "unknown field"),
                       ([{"podSelector": {"matchLabels": {"a": 1}}}], "matchLabels"),
                       ([{"podSelector": {"labels": {}}}], "label selector")]:
        with pytest.raises(ValueError, match=words):
            b.network_peers(bad)


def observed(policy: dict) -> dict:
    """What the operator's index keeps of a policy read back from the API server."""
    return {"metadata": {"name": policy["metadata"]["name"], "namespace": "team", "uid": "np-uid"},
            "spec": policy["spec"]}


def test_decision_creates_the_policy_when_missing_and_not_when_present():
    f = fleet()
    action = decide_network_policy(f, None, enabled=True)
    assert action.verb == "create" and action.obj == b.build_engine_network_policy(f)
    assert decide_network_policy(f, observed(action.obj), enabled=True) is None


def test_decision_restores_a_drifted_policy_and_waits_for_one_being_deleted():
    f = fleet()
    current = observed(b.build_engine_network_policy(f))
    current["spec"]["ingress"] = [{"from": [{"podSelector": {}}]}]  # someone opened it to the namespace
    action = decide_network_policy(f, current, enabled=True)
    assert action.verb == "patch" and action.obj["spec"] == b.build_engine_network_policy(f)["spec"]
    wanted = decide_network_policy(f, None, enabled=True, metrics_from=PROMETHEUS).obj
    assert decide_network_policy(f, observed(b.build_engine_network_policy(f)), enabled=True,
                                 metrics_from=PROMETHEUS).obj["spec"] == wanted["spec"]
    current["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert decide_network_policy(f, current, enabled=True) is None


def test_switched_off_creates_none_and_deletes_the_one_it_made():
    f = fleet()
    assert decide_network_policy(f, None, enabled=False) is None
    current = observed(b.build_engine_network_policy(f))
    action = decide_network_policy(f, current, enabled=False)
    assert action.verb == "delete" and action.obj["metadata"]["uid"] == "np-uid"


def test_operator_flags():
    on = parse_args(["--namespace", "team"])
    assert on.network_policy is True and on.network_policy_metrics_from == []
    off = parse_args(["--namespace", "team", "--no-network-policy"])
    assert off.network_policy is False
    peers = parse_args(["-n", "team", "--network-policy-metrics-from", json.dumps(PROMETHEUS)])
    assert peers.network_policy_metrics_from == PROMETHEUS


@pytest.mark.parametrize("text", ["{", '{"podSelector": {}}', '[{"ipBlock": {}}]'])
def test_bad_metrics_peers_flag_is_a_clear_error(text, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--namespace", "team", "--network-policy-metrics-from", text])
    assert "not a JSON list of NetworkPolicy peers" in capsys.readouterr().err


# The router's NetworkPolicy -----------------------------------------------------------------------------
def test_router_policy_selects_only_the_fleets_router_pods():
    f = fleet()
    policy = b.build_router_network_policy(f)
    meta = policy["metadata"]
    assert (meta["name"], meta["namespace"]) == ("run1-rollout-router", "team")
    assert meta["ownerReferences"][0]["uid"] == "fleet-uid"
    assert meta["labels"][b.LABEL_COMPONENT] == b.ROUTER_NETWORK_POLICY_COMPONENT
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    selector = policy["spec"]["podSelector"]
    assert selects(selector, b.build_router_deployment(f)["spec"]["template"]["metadata"]["labels"])
    other = b.build_router_deployment(fleet(name="other"))["spec"]["template"]["metadata"]["labels"]
    assert not selects(selector, other)
    assert not selects(selector, b.build_engine_pod(f, 0)["metadata"]["labels"])


def test_only_the_runs_trainer_reaches_the_router():
    f = fleet()
    policy = b.build_router_network_policy(f)
    trainer = b.build_trainer_pod({"metadata": {"name": "run1", "namespace": "team", "uid": "u"},
                                   "apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
                                   "spec": {"modelPath": "/m"}})["metadata"]["labels"]
    port = b.fleet_spec(f).router.port
    assert admitted(policy, trainer, port)
    assert not admitted(policy, trainer, b.ROUTER_METRICS_PORT)  # no metrics peers configured
    assert not admitted(policy, b.run_labels("run2", "trainer"), port)  # another run's trainer
    assert not admitted(policy, b.engine_labels("run1-rollout", 0), port)  # engines never call the router
    assert not admitted(policy, {b.LABEL_CLIENT: "true"}, port)
    assert not admitted(policy, {}, port)  # any other pod of the namespace


def test_router_of_no_run_admits_labelled_clients_and_metrics_peers_reach_its_metrics_port():
    policy = b.build_router_network_policy(fleet(name="solo", run_name=None), metrics_from=PROMETHEUS)
    port = b.fleet_spec(fleet(name="solo", run_name=None)).router.port
    assert admitted(policy, {b.LABEL_CLIENT: "true"}, port)
    assert not admitted(policy, b.run_labels("solo", "trainer"), port)
    assert policy["spec"]["ingress"][-1] == {"from": PROMETHEUS,
                                             "ports": [{"port": b.ROUTER_METRICS_PORT, "protocol": "TCP"}]}


def test_router_policy_decision_creates_restores_and_deletes():
    f = fleet()
    build = b.build_router_network_policy
    action = decide_network_policy(f, None, enabled=True, build=build)
    assert action.verb == "create" and action.obj == build(f)
    current = observed(action.obj)
    assert decide_network_policy(f, current, enabled=True, build=build) is None
    current["spec"]["ingress"] = [{"from": [{"podSelector": {}}]}]
    assert decide_network_policy(f, current, enabled=True, build=build).verb == "patch"
    assert decide_network_policy(f, current, enabled=False, build=build).verb == "delete"


# Broadcast weight sync: the update group's policies ------------------------------------------------------
def training_run(mode="broadcast", metrics_port=9400):
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
            "metadata": {"name": "run1", "namespace": "team", "uid": "run-uid"},
            "spec": {"modelPath": "/m", "metricsPort": metrics_port, "weightSync": {"mode": mode}}}


def admitted_range(policy: dict, labels: dict, port: int) -> bool:
    """`admitted`, with port ranges (endPort) and rules of any source (no `from`)."""
    for rule in policy["spec"]["ingress"]:
        ranges = [(p["port"], p.get("endPort", p["port"])) for p in rule.get("ports", [])]
        if ranges and not any(lo <= port <= hi for lo, hi in ranges):
            continue
        if "from" not in rule or any(selects(peer["podSelector"], labels) for peer in rule["from"]):
            return True
    return False


def test_a_disk_run_has_no_update_group_policies_nor_port():
    r = training_run("disk")
    assert b.build_trainer_network_policies(r) == []
    assert [p["name"] for p in b.build_trainer_pod(r)["spec"]["containers"][0]["ports"]] == ["metrics"]


def test_only_the_runs_engines_reach_the_trainers_update_group_and_each_other():
    r = training_run(metrics_port=9500)
    trainer_policy, engines_policy = b.build_trainer_network_policies(r)
    for policy in (trainer_policy, engines_policy):
        assert policy["metadata"]["ownerReferences"][0]["uid"] == "run-uid"
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert b.LABEL_FLEET not in policy["metadata"]["labels"]  # not one of a fleet's own policies
    assert [p["metadata"]["name"] for p in (trainer_policy, engines_policy)] == ["run1-trainer", "run1-update-group"]

    trainer_pod = b.build_trainer_pod(r)
    assert {"name": "update-group", "containerPort": 29600, "protocol": "TCP"} in \
        trainer_pod["spec"]["containers"][0]["ports"]
    rollout = b.build_rollout_fleet({**r, "metadata": {**r["metadata"]}})
    rollout["metadata"]["uid"] = "fleet-uid"
    engine = b.build_engine_pod(rollout, 0)["metadata"]["labels"]
    eval_engine = b.engine_labels("run1-eval", 0)
    other_engine = b.engine_labels("run2-rollout", 0)
    router = b.router_labels("run1-rollout")

    assert selects(trainer_policy["spec"]["podSelector"], trainer_pod["metadata"]["labels"])
    assert not selects(trainer_policy["spec"]["podSelector"], engine)
    assert admitted_range(trainer_policy, engine, 29600)  # the rendezvous (rank 0's TCP store)
    assert admitted_range(trainer_policy, engine, 40000)  # gloo / NCCL connections, ephemeral ports
    assert not admitted_range(trainer_policy, engine, 22)
    for stranger in (eval_engine, other_engine, router, {b.LABEL_CLIENT: "true"}):
        assert not admitted_range(trainer_policy, stranger, 29600), stranger
        assert not admitted_range(trainer_policy, stranger, 40000), stranger
    assert admitted_range(trainer_policy, router, 9500)  # the metrics port stays as open as without a policy

    assert selects(engines_policy["spec"]["podSelector"], engine)
    assert not selects(engines_policy["spec"]["podSelector"], eval_engine)
    assert admitted_range(engines_policy, b.engine_labels("run1-rollout", 1), 40000)
    assert not admitted_range(engines_policy, b.engine_labels("run1-rollout", 1), 30000)  # HTTP: the fleet's own
    assert not admitted_range(engines_policy, other_engine, 40000)
    assert not admitted_range(engines_policy, router, 40000)


def test_a_fleet_labelled_with_a_run_it_does_not_belong_to_serves_client_pods():
    """runName on a fleet someone else created: no run's trainer holds its key, so it is a fleet of no run."""
    mine = fleet(run_name="run1", owned=False)
    assert b.owning_run(mine, b.fleet_spec(mine)) is None
    port = b.fleet_spec(mine).router.port
    policy = b.build_router_network_policy(mine)
    assert admitted(policy, {b.LABEL_CLIENT: "true"}, port)
    trainer = {b.LABEL_COMPONENT: "trainer", b.LABEL_RUN: "run1"}
    assert not admitted(policy, trainer, port)
    assert b.LABEL_RUN not in b.build_engine_pod(mine, 0)["metadata"]["labels"]
    assert b.owning_run(fleet(), b.fleet_spec(fleet())) == "run1"
