"""The dev cluster's node agent plans the pods the operator builds, restricted securityContext,
read-only snapshot mounts and the fleet's key (secretKeyRef) included: it runs them as local processes
of its own user (runAsUser/runAsNonRoot describe a container user it does not switch to)."""
from pathlib import Path

from rlfleet.devcluster.node_agent import plan
from rlfleet.operator import builders as b

PY = "/opt/py/bin/python"


def _fleet():
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": "q-rollout", "namespace": "ns", "uid": "f-uid", "annotations": {}},
            "spec": {"replicas": 1, "runName": "q", "snapshots": {"claimName": "q-snapshots", "mountPath": "/snap"},
                     "engine": {"modelPath": "/snap/step_0", "device": "cpu"}}}


def test_engine_pod_of_the_operator_plans_with_its_key_and_the_claim(tmp_path: Path):
    pod = b.build_engine_pod(_fleet(), 0)
    pod["metadata"]["uid"] = "p-uid"
    assert pod["spec"]["securityContext"]["runAsUser"] == 1000
    container = pod["spec"]["containers"][0]
    volumes = plan.volume_host_paths(pod, tmp_path)
    secrets = {("secret", "q-rollout-api-key"): {"api-key": "k" * 64}}
    planned = plan.plan_container(pod, container, pod_ip="127.0.0.20", node_name="n", volume_paths=volumes,
                                  image_map=plan.ImageMap(plan.default_image_rules(PY)), config_data=secrets)
    assert planned.argv[planned.argv.index("--api-key") + 1] == "k" * 64
    assert planned.argv[planned.argv.index("--host") + 1] == "127.0.0.20"
    claim = tmp_path / "claims" / "ns" / "q-snapshots"
    assert planned.argv[planned.argv.index("--model-path") + 1] == str(claim / "step_0")


def test_router_pod_of_the_operator_plans_with_one_key_for_both_planes(tmp_path: Path):
    template = b.build_router_deployment(_fleet())["spec"]["template"]
    pod = {"metadata": {**template["metadata"], "name": "q-rollout-router-x", "namespace": "ns", "uid": "r-uid"},
           "spec": template["spec"]}
    container = pod["spec"]["containers"][0]
    planned = plan.plan_container(pod, container, pod_ip="127.0.0.21", node_name="n",
                                  volume_paths=plan.volume_host_paths(pod, tmp_path),
                                  image_map=plan.ImageMap(plan.default_image_rules(PY)),
                                  config_data={("secret", "q-rollout-api-key"): {"api-key": "k1"}})
    assert planned.argv[planned.argv.index("--api-key") + 1] == "k1"
    assert planned.argv[planned.argv.index("--control-plane-api-keys") + 1] == "rlfleet:rlfleet:admin:k1"
