"""Pure builders of the operator's objects: engine pods, routers, trainer, claims and child fleets."""
import pytest
from pydantic import ValidationError

from rlfleet.crds.specs import EngineSpec
from rlfleet.operator import builders as b
from rlfleet.sglang.launch import build_engine_launch


def fleet(**spec):
    base = {"replicas": 2, "engine": {"modelPath": "/models/tiny", "device": "cpu", "maxTotalTokens": 4096}}
    base.update(spec)
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": "run1-rollout", "namespace": "team", "uid": "fleet-uid", "annotations": {}},
            "spec": base}


def run(**spec):
    base = {"modelPath": "/models/base", "rollout": {"replicas": 2, "engine": {"device": "cpu"}},
            "trainer": {"image": "rlfleet/rlfleet:0.1.0", "gpus": 0}, "weightSync": {"mountPath": "/snapshots",
                                                                                 "snapshotVolume": {"size": "5Gi"}}}
    base.update(spec)
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
            "metadata": {"name": "run1", "namespace": "team", "uid": "run-uid"}, "spec": base}


def test_engine_pod_has_stable_slot_identity_and_owner():
    pod = b.build_engine_pod(fleet(), 1, restarts=3)
    meta = pod["metadata"]
    assert meta["name"] == "run1-rollout-engine-1"
    assert meta["labels"][b.LABEL_SLOT] == "1" and meta["labels"][b.LABEL_FLEET] == "run1-rollout"
    assert meta["annotations"][b.ANN_RESTARTS] == "3"
    assert meta["ownerReferences"] == [{"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
                                        "name": "run1-rollout", "uid": "fleet-uid", "controller": True,
                                        "blockOwnerDeletion": True}]
    assert pod["spec"]["restartPolicy"] == "Never"


def test_engine_command_is_the_one_builder_output_bound_to_the_pod_ip():
    pod = b.build_engine_pod(fleet(), 0)
    c = pod["spec"]["containers"][0]
    expected = build_engine_launch(EngineSpec.model_validate(fleet()["spec"]["engine"]), host="$(POD_IP)",
                                   model_path="/models/tiny", weight_version="0", api_key="$(RLFLEET_API_KEY)")
    assert c["command"] == expected.argv("python3")
    assert c["command"][:3] == ["python3", "-m", "sglang.launch_server"]
    names = [e["name"] for e in c["env"]]
    assert names[0] == "POD_IP" and c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in c["env"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 30000, "protocol": "TCP"}]


def test_engines_of_a_run_have_no_liveness_probe_and_a_fleet_of_no_run_takes_its_health_spec():
    # A run's fleet: the run's orchestrator heart-beats its engines.
    of_run = b.build_rollout_fleet(run())
    of_run["metadata"]["uid"] = "fleet-uid"
    run_pod = b.build_engine_pod(of_run, 0)["spec"]["containers"][0]
    assert "livenessProbe" not in run_pod and "startupProbe" not in run_pod
    solo = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": "solo", "namespace": "team", "uid": "solo-uid"},
            "spec": {"engine": {"modelPath": "/m", "device": "cpu"},
                     "health": {"intervalSeconds": 2.5, "timeoutSeconds": 0.5, "failureThreshold": 4,
                                "startupTimeoutSeconds": 95}}}
    c = b.build_engine_pod(solo, 0)["spec"]["containers"][0]
    assert c["livenessProbe"] == {"httpGet": {"path": "/health_generate", "port": "http"}, "periodSeconds": 3,
                                  "timeoutSeconds": 1, "failureThreshold": 4, "successThreshold": 1}
    # The operator's startup timeout (95 s) ends a start before the startup probe's 10 x 11 s budget does.
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 110
    edited = {**solo, "spec": {**solo["spec"], "health": {"intervalSeconds": 5}}}
    assert b.engine_spec_digest(b.fleet_spec(edited)) != b.engine_spec_digest(b.fleet_spec(solo))


def test_gpu_engine_requests_gpus_and_shared_memory():
    f = fleet(engine={"modelPath": "/m", "device": "cuda", "gpusPerEngine": 2, "tensorParallelSize": 2})
    pod = b.build_engine_pod(f, 0)
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    cpu = b.build_engine_pod(fleet(), 0)["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in str(cpu["resources"])


def test_engine_pod_mounts_the_shared_snapshot_claim_read_only():
    f = fleet(snapshots={"claimName": "run1-snapshots", "mountPath": "/snap"})
    pod = b.build_engine_pod(f, 0)
    assert pod["spec"]["volumes"][0] == {"name": "snapshots",
                                         "persistentVolumeClaim": {"claimName": "run1-snapshots", "readOnly": True}}
    assert pod["spec"]["containers"][0]["volumeMounts"][0] == {"name": "snapshots", "mountPath": "/snap",
                                                               "readOnly": True}


def test_tiny_model_init_container_writes_the_claim_the_engine_reads_read_only():
    f = fleet(engine={"modelPath": "tiny://qwen2?seed=3", "device": "cpu"},
              snapshots={"claimName": "run1-snapshots", "mountPath": "/snap"})
    spec = b.build_engine_pod(f, 0)["spec"]
    init, engine = spec["initContainers"][0], spec["containers"][0]
    assert init["volumeMounts"] == [{"name": "snapshots", "mountPath": "/snap"}]
    assert engine["volumeMounts"] == [{"name": "snapshots", "mountPath": "/snap", "readOnly": True}]
    assert "readOnly" not in spec["volumes"][0]["persistentVolumeClaim"]  # else the init container could not write


RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                  "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_specs():
    gpu = fleet(engine={"modelPath": "/m", "device": "cuda", "gpusPerEngine": 2, "tensorParallelSize": 2})
    tiny = fleet(engine={"modelPath": "tiny://qwen2?seed=3", "device": "cpu"})
    return {"cpu engine": b.build_engine_pod(fleet(), 0)["spec"], "gpu engine": b.build_engine_pod(gpu, 0)["spec"],
            "tiny engine": b.build_engine_pod(tiny, 0)["spec"],
            "router": b.build_router_deployment(fleet())["spec"]["template"]["spec"],
            "trainer": b.build_trainer_pod(run())["spec"]}


@pytest.mark.parametrize("which", ["cpu engine", "gpu engine", "tiny engine", "router", "trainer"])
def test_every_pod_and_container_is_pod_security_restricted(which):
    spec = _pod_specs()[which]
    assert spec["securityContext"] == RESTRICTED_POD
    containers = spec["containers"] + spec.get("initContainers", [])
    assert len(containers) == (2 if which in ("tiny engine", "router") else 1)  # + init / engine follower
    for c in containers:
        assert c["securityContext"] == RESTRICTED_CONTAINER, c["name"]
    assert not any("hostPath" in v for v in spec.get("volumes", []))


def _key_env(container: dict) -> dict:
    return next(e for e in container["env"] if e["name"] == "RLFLEET_API_KEY")


def test_engines_router_and_trainer_get_the_fleet_key_from_its_secret():
    engine = b.build_engine_pod(fleet(), 0)["spec"]["containers"][0]
    ref = {"secretKeyRef": {"name": "run1-rollout-api-key", "key": "api-key"}}
    assert _key_env(engine)["valueFrom"] == ref
    assert engine["command"][engine["command"].index("--api-key") + 1] == "$(RLFLEET_API_KEY)"
    router = b.build_router_deployment(fleet())["spec"]["template"]["spec"]["containers"][0]
    assert _key_env(router)["valueFrom"] == ref
    cmd = router["command"]
    assert cmd[cmd.index("--api-key") + 1] == "$(RLFLEET_API_KEY)"
    assert cmd[cmd.index("--control-plane-api-keys") + 1] == "rlfleet:rlfleet:admin:$(RLFLEET_API_KEY)"
    trainer = b.build_trainer_pod(run())["spec"]["containers"][0]
    assert _key_env(trainer)["valueFrom"] == ref  # the rollout fleet's Secret: the eval fleet's holds the same key
    assert "value" not in _key_env(trainer)  # the key itself is never in a pod spec


def test_api_key_secret_is_owned_immutable_and_labelled_for_its_fleet():
    secret = b.build_api_key_secret(run(), "run1-rollout", "k" * 64)
    assert secret["metadata"]["name"] == "run1-rollout-api-key"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "run-uid"
    assert secret["immutable"] is True
    assert secret["stringData"] == {"api-key": "k" * 64}
    assert secret["metadata"]["labels"][b.LABEL_FLEET] == "run1-rollout"


def _model_of(f: dict) -> tuple[str, str]:
    cmd = b.build_engine_pod(f, 0)["spec"]["containers"][0]["command"]
    return cmd[cmd.index("--model-path") + 1], cmd[cmd.index("--weight-version") + 1]


def test_replacement_starts_from_the_snapshot_the_orchestrator_pinned_on_the_claim():
    f = fleet(snapshots={"claimName": "run1-snapshots", "mountPath": "/snapshots"})
    f["status"] = {"orchestrator": {"modelPath": "/snapshots/step_7", "weightVersion": "7"}}
    assert _model_of(f) == ("/snapshots/step_7", "7")
    # A pin anywhere but the fleet's own snapshot claim is not used: the spec's model, version 0.
    for elsewhere in ("/etc", "/snapshots/../etc", "/snapshotsX/step_7", "relative/step_7", "hf-org/model"):
        f["status"]["orchestrator"]["modelPath"] = elsewhere
        assert _model_of(f) == ("/models/tiny", "0"), elsewhere
    unmounted = fleet()
    unmounted["status"] = {"orchestrator": {"modelPath": "/snapshots/step_7", "weightVersion": "7"}}
    assert _model_of(unmounted) == ("/models/tiny", "0")
    # Annotations on the fleet are no channel any more.
    f["metadata"]["annotations"] = {"rlfleet.io/model-path": "/snapshots/step_9"}
    del f["status"]
    assert _model_of(f) == ("/models/tiny", "0")


def test_tiny_model_is_written_by_an_init_container_per_pod():
    f = fleet(engine={"modelPath": "tiny://llama?seed=3", "device": "cpu"},
              snapshots={"claimName": "c", "mountPath": "/snapshots"})
    pod = b.build_engine_pod(f, 0, rlfleet_image="rlfleet/rlfleet:9")
    init = pod["spec"]["initContainers"][0]
    path = "/snapshots/models/$(POD_NAME)/tiny-llama-seed3"
    assert init["image"] == "rlfleet/rlfleet:9"
    assert init["command"] == ["rlfleet", "tiny-model", path, "--seed", "3", "--arch", "llama"]
    cmd = pod["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--model-path") + 1] == path


def test_bad_fleet_spec_raises_with_the_field():
    with pytest.raises(ValidationError, match="replicas"):
        b.build_engine_pod(fleet(replicas=-1), 0)


def test_router_deployment_and_service_select_the_router_pod():
    dep = b.build_router_deployment(fleet())
    svc = b.build_router_service(fleet())
    assert dep["metadata"]["name"] == svc["metadata"]["name"] == "run1-rollout-router"
    tmpl_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(tmpl_labels[k] == v for k, v in dep["spec"]["selector"]["matchLabels"].items())
    assert all(tmpl_labels[k] == v for k, v in svc["spec"]["selector"].items())
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:3] == ["python3", "-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--host") + 1] == "$(POD_IP)" and cmd[cmd.index("--policy") + 1] == "cache_aware"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 30000, "metrics": b.ROUTER_METRICS_PORT}


def test_a_fleet_of_no_runs_router_pod_follows_its_engine_pods_and_a_runs_does_not():
    """No trainer registers a fleet of no run's engines: `rlfleet follow-engines` beside its router does, with
    an account that reads pods. A run's trainer registers the engines that serve its weights, so its fleets'
    router pods have one container and hold no token."""
    standalone = b.build_router_deployment(fleet(), follower_image="reg/rlfleet-operator:9")["spec"]["template"]["spec"]
    assert standalone["serviceAccountName"] == b.ROUTER_SERVICE_ACCOUNT == "rlfleet-router"
    assert standalone["automountServiceAccountToken"] is True
    router, follower = standalone["containers"]
    assert follower["name"] == "engine-follower" and follower["image"] == "reg/rlfleet-operator:9"
    cmd = follower["command"]
    assert cmd[:2] == ["rlfleet", "follow-engines"]

    def arg(name):
        return cmd[cmd.index(name) + 1]

    assert (arg("--namespace"), arg("--fleet"), arg("--fleet-uid")) == ("team", "run1-rollout", "fleet-uid")
    engine = b.build_engine_pod(fleet(), 0)["spec"]["containers"][0]
    assert arg("--engine-port") == str(engine["ports"][0]["containerPort"])
    router_port = router["ports"][0]["containerPort"]
    assert arg("--router") == f"http://$(POD_IP):{router_port}"
    assert router["command"][router["command"].index("--host") + 1] == "$(POD_IP)"  # the router binds the pod IP
    assert _key_env(follower) == _key_env(router)
    assert (arg("--health-host"), arg("--health-port")) == ("$(POD_IP)", "29001")
    probe = follower["readinessProbe"]["httpGet"]
    assert probe["path"] == "/ready" and [p["containerPort"] for p in follower["ports"] if p["name"] == probe[
        "port"]] == [29001]
    assert 29001 not in [p["containerPort"] for p in router["ports"]]
    assert {e["name"] for e in follower["env"]} >= {"POD_IP", "RLFLEET_API_KEY"}

    owned = b.build_rollout_fleet(run())
    owned["metadata"] |= {"namespace": "team", "uid": "rollout-uid"}
    of_run = b.build_router_deployment(owned)["spec"]["template"]["spec"]
    assert of_run["automountServiceAccountToken"] is False and "serviceAccountName" not in of_run
    assert [c["name"] for c in of_run["containers"]] == ["router"]
    # A fleet that names a run it does not belong to is a fleet of no run: its engines are followed.
    labelled = b.build_router_deployment(fleet(runName="run1"))["spec"]["template"]["spec"]
    assert [c["name"] for c in labelled["containers"]] == ["router", "engine-follower"]


def test_router_rbac_reads_pods_and_nothing_else():
    sa, role, binding = b.build_router_rbac("team")
    assert sa["kind"] == "ServiceAccount" and sa["metadata"]["name"] == "rlfleet-router"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == "rlfleet-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rlfleet-router", "namespace": "team"}]
    assert [o["metadata"]["name"] for o in b.build_trainer_rbac("team")] == ["rlfleet-trainer"] * 3


def test_run_children_are_owned_by_the_run_and_share_the_claim():
    r = run()
    pvc = b.build_snapshot_pvc(r)
    rf = b.build_rollout_fleet(r)
    trainer = b.build_trainer_pod(r)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    for obj in (pvc, rf, trainer):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "run-uid"
    assert rf["metadata"]["name"] == "run1-rollout"
    assert rf["spec"]["engine"]["modelPath"] == "/models/base"
    assert rf["spec"]["snapshots"] == {"claimName": "run1-snapshots", "mountPath": "/snapshots"}
    assert rf["spec"]["runName"] == "run1"
    assert trainer["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "run1-snapshots"


def test_named_claim_is_used_and_not_created():
    r = run(weightSync={"mountPath": "/s", "snapshotVolume": {"claimName": "shared-rwx"}})
    assert b.build_snapshot_pvc(r) is None
    assert b.build_rollout_fleet(r)["spec"]["snapshots"]["claimName"] == "shared-rwx"


def test_trainer_pod_runs_rlfleet_in_kubernetes_mode():
    t = b.build_trainer_pod(run())
    c = t["spec"]["containers"][0]
    assert c["command"] == ["rlfleet", "run", "--kubernetes", "--namespace", "team", "--training-run", "run1"]
    assert {"name": "RLFLEET_SNAPSHOT_DIR", "value": "/snapshots"} in c["env"]
    assert t["spec"]["serviceAccountName"] == b.TRAINER_SERVICE_ACCOUNT
    assert t["spec"]["restartPolicy"] == "Never"


def test_trainer_pod_gets_the_wandb_api_key_from_the_users_secret_only():
    def env(**tracking):
        c = b.build_trainer_pod(run(trainer={"image": "i", "gpus": 0, "env": [{"name": "WANDB_API_KEY", "value": "x"}]},
                                    tracking=tracking))["spec"]["containers"][0]
        return [e for e in c["env"] if e["name"] == "WANDB_API_KEY"]

    assert env(wandb={"project": "p", "apiKey": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}})[-1] == {
        "name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}  # the last counts
    assert env(wandb={"project": "p", "mode": "offline"}) == [{"name": "WANDB_API_KEY", "value": "x"}]
    assert env(tensorboard={}) == [{"name": "WANDB_API_KEY", "value": "x"}]


def test_trainer_pod_runs_the_operators_trainer_image_unless_the_spec_names_one():
    unset = run(trainer={"gpus": 0})
    assert b.build_trainer_pod(unset)["spec"]["containers"][0]["image"] == b.DEFAULT_RLFLEET_IMAGE
    pods = b.build_trainer_pods(unset, rlfleet_image="reg.example/rl/trainer:9")
    assert [p["spec"]["containers"][0]["image"] for p in pods] == ["reg.example/rl/trainer:9"]
    named = run(trainer={"gpus": 0, "image": "reg.example/mine:1"})
    assert b.build_trainer_pod(named, rlfleet_image="reg.example/rl/trainer:9")["spec"]["containers"][0][
        "image"] == "reg.example/mine:1"


def test_trainer_pod_asks_for_a_device_per_rank():
    def resources(**trainer):
        spec = run(trainer={"image": "rlfleet/rlfleet:0.1.0", **trainer})
        return b.build_trainer_pod(spec)["spec"]["containers"][0].get("resources", {})

    assert resources(gpus=0) == {}
    assert resources(gpus=0, dataParallelSize=2) == {"requests": {"cpu": "2"}}
    assert resources(gpus=0, dataParallelSize=2, resources={"requests": {"cpu": "500m"}}) == {
        "requests": {"cpu": "500m"}}
    # A CPU limit below a core per rank caps the request (the API server refuses a request over its limit).
    assert resources(gpus=0, dataParallelSize=4, resources={"limits": {"cpu": "2"}}) == {
        "requests": {"cpu": "2"}, "limits": {"cpu": "2"}}
    assert resources(gpus=0, dataParallelSize=2, resources={"limits": {"cpu": "8"}}) == {
        "requests": {"cpu": "2"}, "limits": {"cpu": "8"}}
    assert resources(gpus=4, backend="megatron", tensorParallelSize=2, dataParallelSize=2) == {
        "requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}


def test_eval_fleet_only_for_posture_fleet_and_inherits_the_engine():
    assert b.build_eval_fleet(run()) is None
    r = run(eval={"posture": "fleet", "datasets": [{"name": "d", "task": "reverse"}],
                  "fleet": {"replicas": 1, "engine": {"maxTotalTokens": 2048}}})
    ef = b.build_eval_fleet(r)
    assert ef["kind"] == "EvalFleet" and ef["metadata"]["name"] == "run1-eval"
    assert ef["spec"]["replicas"] == 1
    assert ef["spec"]["engine"]["maxTotalTokens"] == 2048
    assert ef["spec"]["engine"]["device"] == "cpu" and ef["spec"]["engine"]["modelPath"] == "/models/base"


def test_the_quickstart_example_builds_valid_children():
    """examples/quickstart.yaml as the API server stores it (defaults filled) -> every child object."""
    from pathlib import Path

    from rlfleet.crds.loader import parse_yaml, validate_object
    from rlfleet.crds.specs import wire_dump

    text = (Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml").read_text()
    model, errors = validate_object(parse_yaml(text)[0])
    assert not errors
    stored = wire_dump(model)
    stored["metadata"].update(namespace="team", uid="run-uid")
    rollout, evalf = b.build_rollout_fleet(stored), b.build_eval_fleet(stored)
    assert rollout["spec"]["replicas"] == 2 and evalf["spec"]["replicas"] == 1
    for fleet in (rollout, evalf):
        fleet["metadata"]["uid"] = "fleet-uid"
        pod = b.build_engine_pod(fleet, 0)
        init = pod["spec"]["initContainers"][0]
        assert init["command"][:2] == ["rlfleet", "tiny-model"]  # tiny://llama?seed=0, written per pod
        assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "quickstart-snapshots"
    assert b.build_snapshot_pvc(stored)["metadata"]["name"] == "quickstart-snapshots"
    assert b.build_trainer_pod(stored)["spec"]["containers"][0]["command"][:3] == ["rlfleet", "run", "--kubernetes"]


def test_a_malformed_tiny_path_of_a_fleet_is_served_as_given():
    f = fleet(engine={"modelPath": "tiny://gpt2", "device": "cpu"})
    pod = b.build_engine_pod(f, 0)
    assert "initContainers" not in pod["spec"]
    cmd = pod["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--model-path") + 1] == "tiny://gpt2"


def test_builders_use_the_typed_spec_they_are_given():
    from rlfleet.crds.fleet_specs import FleetSpec

    f = fleet()
    spec = FleetSpec.model_validate({**f["spec"], "router": {"policy": "round_robin"}})
    cmd = b.build_router_deployment(f, spec)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin"
    assert b.build_engine_pod(fleet(replicas=-1), 0, spec=spec)["metadata"]["name"] == "run1-rollout-engine-0"


def test_run_children_read_their_defaults_from_the_models():
    r = run(weightSync={})
    assert b.build_snapshot_pvc(r)["spec"]["resources"]["requests"]["storage"] == "20Gi"
    trainer = b.build_trainer_pod(r)["spec"]["containers"][0]
    assert trainer["ports"][0]["containerPort"] == 9400
    assert trainer["volumeMounts"] == [{"name": "snapshots", "mountPath": "/snapshots"}]
    assert b.build_rollout_fleet(r)["spec"]["snapshots"] == {"claimName": "run1-snapshots", "mountPath": "/snapshots"}
