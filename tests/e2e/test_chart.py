"""The Helm chart with the pinned helm: lint, schema, rendered RBAC, and a server-side dry run."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from helpers.cluster import CHART, OperatorProcess, get_json, wait_for
from helpers.cluster import helm as cluster_helm
from rlfleet.util.binaries import tool_path


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool_path("helm")), *args], capture_output=True, text=True, timeout=120, check=check)


def rendered(*sets: str) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    out = helm("template", "rlfleet", str(CHART), "-n", "rlfleet-system", "--include-crds", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("sets", [
    (),
    ("watchNamespaces={a,b}", "peering.enabled=true", "operator.replicas=2", "metrics.serviceMonitor.enabled=true"),
    ("clusterWide=true", "peering.enabled=true", "operator.replicas=2"),
])
def test_lint_is_clean(sets):
    args = [a for s in sets for a in ("--set", s)]
    result = helm("lint", str(CHART), "--strict", *args)
    assert "0 chart(s) failed" in result.stdout and "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


@pytest.mark.parametrize("bad,words", [
    ("operator.bogus=1", "additional properties 'bogus' not allowed"),
    ("watchNamespaces={Bad_NS}", "watchNamespaces"),
    ("image.pullPolicy=Sometimes", "pullPolicy"),
])
def test_values_schema_rejects_bad_values(bad, words):
    result = helm("template", "x", str(CHART), "--set", bad, check=False)
    assert result.returncode != 0 and words in result.stderr, result.stderr


def test_two_replicas_need_peering():
    result = helm("template", "x", str(CHART), "--set", "operator.replicas=2", check=False)
    assert result.returncode != 0 and "needs peering.enabled=true" in result.stderr


@pytest.mark.parametrize(("sets", "words"), [
    (("--set", "networkPolicy.enabled=false", "--set-json", 'networkPolicy.metricsFrom=[{"podSelector": {}}]'),
     "needs networkPolicy.enabled=true"),
    (("--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.service.enabled=false"),
     "needs metrics.service.enabled=true"),
])
def test_values_that_could_not_take_effect_are_refused(sets, words):
    result = helm("template", "x", str(CHART), *sets, check=False)
    assert result.returncode != 0 and words in result.stderr, result.stderr


def test_namespaced_install_grants_no_secret_reads_and_nothing_cluster_wide():
    docs = rendered("watchNamespaces={team-a}")
    kinds = {d["kind"] for d in docs}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = [d for d in docs if d["kind"] == "Role"]
    assert {(r["metadata"]["name"], r["metadata"]["namespace"]) for r in roles} == {
        ("rlfleet-operator", "team-a"), ("rlfleet-trainer", "team-a"), ("rlfleet-router", "team-a")}
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["resources"] + rule["verbs"]
            if "secrets" in rule["resources"]:  # the operator creates fleet keys; nobody may read a Secret
                assert role["metadata"]["name"] == "rlfleet-operator" and rule["verbs"] == ["create"], rule
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert {"trainingruns.rlfleet.io", "rolloutfleets.rlfleet.io", "evalfleets.rlfleet.io",
            "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= crds


def test_default_values_serve_the_release_namespace_only_with_a_trainer_account_there():
    docs = rendered()
    kinds = {d["kind"] for d in docs}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = {(d["kind"], d["metadata"]["name"], d["metadata"]["namespace"]) for d in docs
             if d["kind"] in ("Role", "RoleBinding")}
    assert roles == {(k, n, "rlfleet-system") for k in ("Role", "RoleBinding")
                     for n in ("rlfleet-operator", "rlfleet-trainer", "rlfleet-router")}
    accounts = {(d["metadata"]["name"], d["metadata"]["namespace"]) for d in docs if d["kind"] == "ServiceAccount"}
    assert {("rlfleet-trainer", "rlfleet-system"), ("rlfleet-router", "rlfleet-system")} <= accounts
    args = _operator_args()
    assert args.namespace == ["rlfleet-system"] and not args.all_namespaces and not args.workload_rbac


def test_cluster_wide_needs_its_own_switch_and_then_the_operator_provisions_trainer_accounts():
    refused = helm("template", "x", str(CHART), "--set", "clusterWide=true", "--set", "watchNamespaces={a}",
                   check=False)
    assert refused.returncode != 0 and "clusterWide=true serves every namespace" in refused.stderr, refused.stderr
    docs = rendered("clusterWide=true")
    assert {d["kind"] for d in docs} >= {"ClusterRole", "ClusterRoleBinding"}
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    assert "rlfleet-trainer" not in {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    args = _operator_args("--set", "clusterWide=true")
    assert args.all_namespaces and args.namespace == [] and args.workload_rbac


def test_the_charts_trainer_and_router_roles_are_the_operators():
    """The chart renders the same trainer and router rules the operator grants in cluster-wide installs,
    bound to the accounts the operator's pods name."""
    from rlfleet.operator.builders import ROUTER_RULES, TRAINER_RULES

    docs = rendered("watchNamespaces={team-a}")
    for account, rules in (("rlfleet-trainer", TRAINER_RULES), ("rlfleet-router", ROUTER_RULES)):
        role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == account)
        assert role["metadata"]["namespace"] == "team-a" and role["rules"] == list(rules)
        for rule in role["rules"]:  # read only, except status
            assert (set(rule["verbs"]) <= {"get", "list", "watch"}
                    or all(r.endswith("/status") for r in rule["resources"]))
        binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == account)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "team-a"}]
        assert any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == account for d in docs)
    # The accounts' names are the operator's, not values (a renamed account would leave its pods refused).
    result = helm("template", "x", str(CHART), "--set", "trainer.serviceAccountName=other", check=False)
    assert result.returncode != 0 and "serviceAccountName" in result.stderr, result.stderr


def test_crds_come_from_the_one_source(tmp_path):
    """The chart's CRDs are the generated ones in crds/ (links), never copies that drift."""
    for plural in ("trainingruns", "rolloutfleets", "evalfleets"):
        link = CHART / "crds" / f"{plural}.yaml"
        assert link.is_symlink() and link.resolve() == (CHART.parents[1] / "crds" / f"{plural}.yaml").resolve()


@pytest.mark.cluster
def test_rendered_chart_is_accepted_by_the_api_server(control_plane):
    for ns in ("chart-dry-run", "rlfleet-system"):
        control_plane.kubectl("create", "namespace", ns, check=False)
    docs = rendered("watchNamespaces={chart-dry-run}", "peering.enabled=true", "operator.replicas=2")
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    control_plane.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(crds))
    rest = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
    result = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(rest), check=False)
    assert result.returncode == 0, result.stderr


NETWORK_POLICY_RULE = {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
                       "verbs": ["get", "list", "watch", "create", "patch", "delete"]}
PROMETHEUS_PEERS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


@pytest.mark.parametrize("sets", [("watchNamespaces={team-a}",), (), ("clusterWide=true",)])
def test_operator_role_manages_network_policies(sets):
    docs = rendered(*sets)
    role = next(d for d in docs if d["kind"] in ("Role", "ClusterRole") and "rlfleet-operator" in d["metadata"]["name"])
    assert NETWORK_POLICY_RULE in role["rules"]


SECRET_RULE = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}


@pytest.mark.parametrize("sets", [("watchNamespaces={team-a}",), ()])
def test_operator_may_create_fleet_key_secrets_but_not_read_any(sets):
    docs = rendered(*sets)
    role = next(d for d in docs if d["kind"] in ("Role", "ClusterRole") and "rlfleet-operator" in d["metadata"]["name"])
    assert SECRET_RULE in role["rules"]
    assert not [r for r in role["rules"] if "secrets" in r["resources"] and set(r["verbs"]) - {"create"}]


def _operator_args(*helm_args: str):
    from rlfleet.operator.main import parse_args

    out = helm("template", "rlfleet", str(CHART), "-n", "rlfleet-system", *helm_args).stdout
    deployment = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["rlfleet", "operator"]
    return parse_args(command[2:])


def test_network_policy_values_reach_the_operator():
    default = _operator_args()
    assert default.network_policy is True and default.network_policy_metrics_from == []
    peers = _operator_args("--set-json", f"networkPolicy.metricsFrom={json.dumps(PROMETHEUS_PEERS)}")
    assert peers.network_policy is True and peers.network_policy_metrics_from == PROMETHEUS_PEERS
    assert _operator_args("--set", "networkPolicy.enabled=false").network_policy is False
    set_peers = f"networkPolicy.metricsFrom={json.dumps(PROMETHEUS_PEERS)}"
    lint = helm("lint", str(CHART), "--strict", "--set-json", set_peers)
    assert "0 chart(s) failed" in lint.stdout and "[WARNING]" not in lint.stdout, lint.stdout


@pytest.mark.parametrize("bad", ['[{"ipBlock": {"cidr": "10.0.0.0/8"}}]', "[{}]",
                                 '[{"podSelector": {"matchLabels": {"a": 1}}}]'])
def test_values_schema_rejects_bad_metrics_peers(bad):
    result = helm("template", "x", str(CHART), "--set-json", f"networkPolicy.metricsFrom={bad}", check=False)
    assert result.returncode != 0 and "networkPolicy/metricsFrom" in result.stderr, result.stderr


def test_the_operator_runs_the_operator_image_and_gives_its_pods_the_trainer_image():
    """Trainer pods and tiny-model init containers run the trainer image; the engine follower beside a fleet
    of no run's router runs the operator's own (light) image."""
    docs = rendered("watchNamespaces={team-a}", "image.tag=1.2.3", "trainerImage.repository=reg.example/rl/trainer")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "rlfleet/rlfleet-operator:1.2.3"
    chart_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert f"--rlfleet-image=reg.example/rl/trainer:{chart_version}" in container["command"]
    assert "--follower-image=rlfleet/rlfleet-operator:1.2.3" in container["command"]
    result = helm("template", "x", str(CHART), "--set", "trainerImage.repository=", check=False)
    assert result.returncode != 0 and "trainerImage" in result.stderr, result.stderr


def _trainer_pod(cp, namespace: str, run: str) -> dict | None:
    return get_json(cp, "pod", f"{run}-trainer", namespace=namespace)


@pytest.mark.cluster
def test_install_with_default_values_admits_the_quickstarts_trainer_pod(control_plane, tmp_path):
    """`helm install` with default values (the operator Deployment at zero replicas: the operator runs
    here with the chart's token), then the quickstart in the release namespace: the trainer pod is
    admitted (its ServiceAccount exists) and the operator has no rights outside the namespace."""
    cp, ns = control_plane, "chart-default"
    cluster_helm(cp, "install", "rlfleet-default", str(CHART), "-n", ns, "--create-namespace",
                 "--set", "operator.replicas=0")
    op = OperatorProcess(cp.service_account_kubeconfig(ns, "rlfleet-operator"), ns, tmp_path)
    try:
        op.start()
        cp.kubectl("apply", "-n", ns, "-f", str(CHART.parents[1] / "examples" / "quickstart.yaml"))
        pod = wait_for(lambda: _trainer_pod(cp, ns, "quickstart"), timeout=90, interval=0.5,
                       what="the quickstart's trainer pod", context=op.tail)
        assert pod["spec"]["serviceAccountName"] == "rlfleet-trainer"
        can_i = cp.kubectl("auth", "can-i", "create", "pods", "-n", "kube-system", kubeconfig=op.kubeconfig,
                           check=False)
        assert can_i.stdout.strip() == "no"
    finally:
        cp.kubectl("delete", "trainingrun", "quickstart", "-n", ns, "--wait=false", check=False)
        op.stop()
        cluster_helm(cp, "uninstall", "rlfleet-default", "-n", ns)


@pytest.mark.cluster
def test_cluster_wide_install_gives_each_namespace_its_trainer_and_router_accounts(control_plane, tmp_path):
    """Cluster-wide, the operator creates the trainer's account where a run is and the router's where a
    fleet of no run is (its router discovers the engines with it: it may read pods, nothing else)."""
    cp, system, team = control_plane, "chart-cluster-wide", "cw-team"
    cp.kubectl("create", "namespace", team, check=False)
    cluster_helm(cp, "install", "rlfleet-cw", str(CHART), "-n", system, "--create-namespace",
                 "--set", "clusterWide=true", "--set", "operator.replicas=0")
    op = OperatorProcess(cp.service_account_kubeconfig(system, "rlfleet-operator"), team, tmp_path,
                         extra_args=("--workload-rbac",))
    run = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "cw", "namespace": team},
           "spec": {"modelPath": "tiny://llama?seed=0", "trainer": {"backend": "torch", "gpus": 0, "steps": 2},
                    "rollout": {"replicas": 1, "engine": {"device": "cpu"}}}}
    try:
        op.start()
        cp.kubectl("apply", "-f", "-", input=json.dumps(run))
        pod = wait_for(lambda: _trainer_pod(cp, team, "cw"), timeout=90, interval=0.5, what="the trainer pod",
                       context=op.tail)
        assert pod["spec"]["serviceAccountName"] == "rlfleet-trainer"
        from rlfleet.operator.builders import TRAINER_RULES

        role = get_json(cp, "role", "rlfleet-trainer", namespace=team)
        assert role is not None and role["rules"] == list(TRAINER_RULES)
        trainer = cp.service_account_kubeconfig(team, "rlfleet-trainer")

        def can_i(*args):
            return cp.kubectl("auth", "can-i", *args, "-n", team, kubeconfig=trainer, check=False).stdout.strip()

        assert can_i("patch", "pods") == "no" and can_i("patch", "trainingruns") == "no"
        assert can_i("patch", "trainingruns", "--subresource=status") == "yes"
        assert can_i("patch", "rolloutfleets", "--subresource=status") == "yes"

        from rlfleet.operator.builders import ROUTER_RULES

        fleet = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
                 "metadata": {"name": "serve", "namespace": team},
                 "spec": {"replicas": 0, "engine": {"modelPath": "tiny://llama?seed=0", "device": "cpu"}}}
        cp.kubectl("apply", "-f", "-", input=json.dumps(fleet))
        router = wait_for(lambda: get_json(cp, "deployment", "serve-router", namespace=team), timeout=60,
                          interval=0.5, what="the fleet's router Deployment", context=op.tail)
        assert router["spec"]["template"]["spec"]["serviceAccountName"] == "rlfleet-router"
        role = get_json(cp, "role", "rlfleet-router", namespace=team)
        assert role is not None and role["rules"] == list(ROUTER_RULES)
        account = cp.service_account_kubeconfig(team, "rlfleet-router")
        assert cp.kubectl("auth", "can-i", "watch", "pods", "-n", team, kubeconfig=account).stdout.strip() == "yes"
        for verb, what in (("get", "secrets"), ("create", "pods"), ("list", "rolloutfleets")):
            assert cp.kubectl("auth", "can-i", verb, what, "-n", team, kubeconfig=account,
                              check=False).stdout.strip() == "no", (verb, what)
    finally:
        cp.kubectl("delete", "rolloutfleet", "serve", "-n", team, "--wait=false", check=False)
        cp.kubectl("delete", "trainingrun", "cw", "-n", team, "--wait=false", check=False)
        op.stop()
        cluster_helm(cp, "uninstall", "rlfleet-cw", "-n", system)
