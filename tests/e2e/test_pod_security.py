"""Every object the operator builds is admitted by a namespace that enforces Pod Security `restricted`.

Real kube-apiserver (`control_plane`, Pod Security admission on, as in every cluster since 1.25): a
namespace labelled `pod-security.kubernetes.io/enforce=restricted`, and a server-side dry-run create of
the operator's own builders' output for the quickstart run (tiny-model engines with their init
container, the eval fleet, router, trainer, claim, Secrets, NetworkPolicies) and for a GPU engine.
The same engine pod without its securityContext is refused: the namespace does enforce.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from rlfleet.operator import builders as b
from rlfleet.sglang.http import new_api_key

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-restricted"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def restricted(control_plane):
    cp = control_plane
    cp.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": NS, "labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                            "pod-security.kubernetes.io/enforce-version": "latest",
                                            "pod-security.kubernetes.io/warn": "restricted"}}}))
    # The trainer's and the router's accounts (the chart provisions them) and the namespace's default one
    # (pods need them).
    for sa in (b.TRAINER_SERVICE_ACCOUNT, b.ROUTER_SERVICE_ACCOUNT, "default"):
        cp.kubectl("create", "serviceaccount", sa, "-n", NS, check=False)
    return cp


def _run() -> dict:
    run = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    run["metadata"].update(namespace=NS, uid="00000000-0000-0000-0000-000000000001")
    return run


def _with_uid(obj: dict, uid: str) -> dict:
    obj = copy.deepcopy(obj)
    obj["metadata"]["uid"] = uid
    return obj


def _pod_of(deployment: dict) -> dict:
    template = deployment["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**template["metadata"], "name": deployment["metadata"]["name"] + "-0", "namespace": NS},
            "spec": template["spec"]}


def built_objects() -> dict[str, dict]:
    run = _run()
    rollout = _with_uid(b.build_rollout_fleet(run), "00000000-0000-0000-0000-000000000002")
    eval_fleet = _with_uid(b.build_eval_fleet(run), "00000000-0000-0000-0000-000000000003")
    gpu = copy.deepcopy(rollout)
    gpu["metadata"]["name"] = "gpu-rollout"
    gpu["spec"]["engine"] = {"modelPath": "/models/qwen", "device": "cuda", "gpusPerEngine": 2,
                             "tensorParallelSize": 2, "image": "lmsysorg/sglang:v0.5.5"}
    key = new_api_key()
    objects = {
        "rollout api key": b.build_api_key_secret(run, rollout["metadata"]["name"], key),
        "snapshot claim": b.build_snapshot_pvc(run),
        "trainer pod": b.build_trainer_pod(run),
        "gpu engine pod": b.build_engine_pod(gpu, 0),
    }
    standalone = _with_uid(rollout, "00000000-0000-0000-0000-000000000004")
    standalone["metadata"].update(name="serve", ownerReferences=[])
    standalone["spec"].pop("runName", None)
    objects["fleet of no run router pod"] = _pod_of(b.build_router_deployment(standalone))  # it mounts a token
    for name, fleet in (("rollout", rollout), ("eval", eval_fleet)):
        router = b.build_router_deployment(fleet)
        objects |= {
            f"{name} engine pod": b.build_engine_pod(fleet, 0),
            f"{name} router deployment": router,
            f"{name} router pod": _pod_of(router),
            f"{name} router service": b.build_router_service(fleet),
            f"{name} engine network policy": b.build_engine_network_policy(fleet),
            f"{name} router network policy": b.build_router_network_policy(fleet),
        }
    return objects


def dry_run(cp, obj: dict):
    return cp.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(obj), check=False)


@pytest.mark.parametrize("which", sorted(built_objects()))
def test_operator_children_are_admitted_by_a_restricted_namespace(restricted, which):
    obj = built_objects()[which]
    result = dry_run(restricted, obj)
    assert result.returncode == 0, f"{which} refused: {result.stderr}"
    assert "PodSecurity" not in result.stderr, result.stderr  # a Deployment's template is only warned about
    admitted = json.loads(result.stdout)
    if obj["kind"] == "Pod":
        assert admitted["spec"]["securityContext"]["runAsNonRoot"] is True


def test_an_engine_pod_without_its_security_context_is_refused(restricted):
    pod = built_objects()["rollout engine pod"]
    pod["spec"].pop("securityContext")
    for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        c.pop("securityContext")
    result = dry_run(restricted, pod)
    assert result.returncode != 0
    assert "violates PodSecurity" in result.stderr and "restricted" in result.stderr, result.stderr


def test_engines_mount_the_snapshot_claim_read_only_and_the_trainer_writes_it(restricted):
    objects = built_objects()
    for which in ("rollout engine pod", "eval engine pod"):
        admitted = json.loads(dry_run(restricted, objects[which]).stdout)
        engine = admitted["spec"]["containers"][0]
        mounts = [m for m in engine["volumeMounts"] if m["name"] == b.SNAPSHOT_VOLUME]
        assert mounts and all(m.get("readOnly") is True for m in mounts), mounts
    trainer = json.loads(dry_run(restricted, objects["trainer pod"]).stdout)
    assert not trainer["spec"]["containers"][0]["volumeMounts"][0].get("readOnly")
    assert trainer["spec"]["securityContext"]["fsGroup"] == 1000
