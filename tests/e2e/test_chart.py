"""The Helm chart with the pinned helm: lint, schema, rendered RBAC, and a server-side dry run."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from rlfleet.testing_cluster import CHART
from rlfleet.tools import tool_path


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


def test_namespaced_install_grants_no_secrets_and_nothing_cluster_wide():
    docs = rendered("watchNamespaces={team-a}")
    kinds = {d["kind"] for d in docs}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = [d for d in docs if d["kind"] == "Role"]
    assert {(r["metadata"]["name"], r["metadata"]["namespace"]) for r in roles} == {
        ("rlfleet-operator", "team-a"), ("rlfleet-trainer", "team-a")}
    for role in roles:
        for rule in role["rules"]:
            assert "secrets" not in rule["resources"] and "*" not in rule["resources"] + rule["verbs"]
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
