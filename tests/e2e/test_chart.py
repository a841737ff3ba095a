"""The Helm chart with the pinned helm: lint, schema, rendered RBAC, and a server-side dry run."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from helpers.cluster import CHART
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


def test_namespaced_install_grants_no_secret_reads_and_nothing_cluster_wide():
    docs = rendered("watchNamespaces={team-a}")
    kinds = {d["kind"] for d in docs}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = [d for d in docs if d["kind"] == "Role"]
    assert {(r["metadata"]["name"], r["metadata"]["namespace"]) for r in roles} == {
        ("rlfleet-operator", "team-a"), ("rlfleet-trainer", "team-a")}
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["resources"] + rule["verbs"]
            if "secrets" in rule["resources"]:  # the operator creates fleet keys; nobody may read a Secret
                assert role["metadata"]["name"] == "rlfleet-operator" and rule["verbs"] == ["create"], rule
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert {"trainingruns.rlfleet.io", "rolloutfleets.rlfleet.io", "evalfleets.rlfleet.io",
            "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= crds


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


@pytest.mark.parametrize("sets", [("watchNamespaces={team-a}",), ()])
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
