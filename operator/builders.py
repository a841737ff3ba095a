"""Pure builders of the Kubernetes objects the operator owns. No I/O: the object and its typed spec in, dict out.

Every pod passes Pod Security `restricted` (`POD_SECURITY` and `CONTAINER_SECURITY`): non-root
(uid/gid/fsGroup 1000), no privilege escalation, all capabilities dropped, the runtime's seccomp
profile. An SGLang GPU engine needs nothing beyond it: the GPUs come from the device plugin's
resource (`nvidia.com/gpu`), shared memory from a memory-backed emptyDir. Engines mount the snapshot
claim read-only; only the trainer (and a tiny model's init container, into its own directory) writes.

Engines and the router require the fleet's API key (Secret `<fleet>-api-key`, key `api-key`, given to
the containers by `secretKeyRef` as $RLFLEET_API_KEY; `build_api_key_secret`); the router's pods admit
only the run's trainer (NetworkPolicy `<fleet>-router`, `build_router_network_policy`).

A TrainingRun owns (ownerReferences, controller) a RolloutFleet `<run>-rollout`, an optional
EvalFleet `<run>-eval`, the trainer pod `<run>-trainer` and the snapshot claim `<run>-snapshots`
(unless the run names an existing claim). A fleet owns one engine pod per slot,
`<fleet>-engine-<slot>`, its router: Deployment and Service `<fleet>-router`, and (unless switched
off) the NetworkPolicy `<fleet>-engines` that admits only the fleet's own clients to its engines.

The names, labels and annotations the children carry are the contract in rlfleet.crds.conventions.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

from rlfleet.crds.conventions import (  # noqa: F401 - the operator's modules read them as b.NAME
    ANN_ENGINE_SPEC,
    ANN_RESTARTS,
    API_KEY_ENV,
    API_KEY_SECRET_KEY,
    API_VERSION,
    COLLECTIVE_PORTS,
    DEFAULT_OPERATOR_IMAGE,
    DEFAULT_RLFLEET_IMAGE,
    ENGINE_CONTAINER,
    FOLLOWER_HEALTH_PORT,
    GROUP,
    LABEL_CLIENT,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_RUN,
    LABEL_SLOT,
    LABEL_TRAINER_NODE,
    MANAGER,
    POD_USER_ID,
    ROUTER_CONTAINER,
    ROUTER_METRICS_PORT,
    ROUTER_SERVICE_ACCOUNT,
    SNAPSHOT_VOLUME,
    TRAINER_RENDEZVOUS_PORT,
    TRAINER_RENDEZVOUS_PORT_NAME,
    TRAINER_SERVICE_ACCOUNT,
    UPDATE_GROUP_PORT,
    UPDATE_GROUP_PORT_NAME,
    api_key_secret_name,
    engine_labels,
    engine_pod_name,
    engine_selector,
    eval_fleet_name,
    network_policy_name,
    rollout_fleet_name,
    router_labels,
    router_name,
    router_network_policy_name,
    trainer_network_policy_name,
    trainer_pod_name,
    trainer_pod_names,
    update_group_network_policy_name,
)
from rlfleet.crds.derive import eval_fleet_spec, match_tiny_model, rollout_fleet_spec, snapshot_claim_name
from rlfleet.crds.fleet_specs import FleetSpec, RouterSpec, SnapshotMountSpec
from rlfleet.crds.k8s_values import quantity
from rlfleet.crds.managed import ReservedEnv
from rlfleet.crds.models import TrainingRunSpec
from rlfleet.crds.specs import EngineSpec, EnvVarSpec, HealthSpec, ResourcesSpec, wire_dump
from rlfleet.kube.marks import pinned_snapshot
from rlfleet.sglang.launch import build_engine_launch, build_router_args

# Where a fleet without a snapshot volume writes its tiny model (an emptyDir): the usual mount path.
DEFAULT_MOUNT_PATH: str = SnapshotMountSpec.model_fields["mount_path"].default

# Pod-level fields every pod we build shares: no service links (hundreds of env vars in big
# namespaces), explicit grace period, logs as the termination message on failure.
_TERMINATION = {"terminationMessagePolicy": "FallbackToLogsOnError"}

# Pod Security `restricted`, for every pod we build (see the module's docstring).
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": POD_USER_ID,
    "runAsGroup": POD_USER_ID,
    "fsGroup": POD_USER_ID,
    # Chown a claim once (a fresh one), not on every pod start of a volume with thousands of files.
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}


def _secure(container: dict) -> dict:
    return {**container, "securityContext": dict(CONTAINER_SECURITY)}


def owner_reference(owner: dict) -> dict:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owning_run(fleet: dict, spec: FleetSpec) -> str | None:
    """The TrainingRun a fleet belongs to: its runName, when that run is the fleet's controller (the run
    created it). A fleet someone else created and labelled with a runName is a fleet of no run: it holds
    its own API key and serves client pods, as the run's trainer could never reach it."""
    if spec.run_name is None:
        return None
    refs = fleet.get("metadata", {}).get("ownerReferences") or []
    owned = any(r.get("controller") and r.get("kind") == "TrainingRun" and r.get("name") == spec.run_name
                for r in refs)
    return spec.run_name if owned else None


def _meta(name: str, owner: dict, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def _env(pairs: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in pairs.items()]


def _downward_env() -> list[dict]:
    return [
        {"name": ReservedEnv.POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": ReservedEnv.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": ReservedEnv.POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def _user_env(defaults: dict[str, str], user: Sequence[EnvVarSpec]) -> list[dict]:
    """Defaults (a user variable of the same name replaces one), then the user's variables in order,
    `valueFrom` (Secret and ConfigMap keys) included. Reserved names never get here (the API refuses them)."""
    mine = {e.name for e in user}
    return _env({k: v for k, v in defaults.items() if k not in mine}) + [e.to_pod() for e in user]


def api_key_env(fleet_name: str) -> dict:
    """$RLFLEET_API_KEY of a container: the fleet's key, from its Secret."""
    return {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": api_key_secret_name(fleet_name),
                                                                "key": API_KEY_SECRET_KEY}}}


def _tolerations(items: list) -> list[dict]:
    return [{k: v for k, v in t.model_dump(by_alias=True).items() if v is not None} for t in items]


def _resources(resources: ResourcesSpec, gpus: int) -> dict:
    limits = dict(resources.limits)
    requests = dict(resources.requests)
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
        requests["nvidia.com/gpu"] = str(gpus)
    out = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def fleet_spec(fleet: dict) -> FleetSpec:
    """The fleet's spec as the typed model (bad input raises pydantic's ValidationError)."""
    return FleetSpec.model_validate(fleet["spec"])


def run_spec(run: dict) -> TrainingRunSpec:
    """The run's spec as the typed model (bad input raises pydantic's ValidationError)."""
    return TrainingRunSpec.model_validate(run["spec"])


# Each builder takes the object (its metadata names and owns the children) and, when the caller has
# validated it already, its typed spec; without one the builder validates the object's spec itself.


# Engines ---------------------------------------------------------------------------------------------
def engine_spec_digest(spec: FleetSpec) -> str:
    """What an engine pod is built from in the fleet's spec (engine, health, snapshot mount), as a short digest:
    equal digests, equal pods (but for the slot and the pinned weights)."""
    parts = {"engine": wire_dump(spec.engine), "health": wire_dump(spec.health),
             "snapshots": wire_dump(spec.snapshots) if spec.snapshots else None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


# The kubelet gives a starting engine this long between startup probes; the operator's own startup timeout
# (health.startupTimeoutSeconds, with its clearer message) ends a start before the probe's budget does.
STARTUP_PROBE_PERIOD_S = 10


def engine_liveness(health: HealthSpec) -> dict[str, dict]:
    """The probes of an engine of a fleet no run drives: the kubelet heart-beats it with GET /health_generate
    (a one-token generation, as a run's orchestrator does) every `intervalSeconds`, each bounded by
    `timeoutSeconds`, and kills it after `failureThreshold` failures in a row (the operator then recreates
    the slot); a startup probe holds the liveness probe off while the model loads. A run's fleet has none:
    its orchestrator probes the engines and marks the dead ones."""
    return {
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": STARTUP_PROBE_PERIOD_S,
                         "timeoutSeconds": 25, "successThreshold": 1,
                         "failureThreshold": math.ceil(health.startup_timeout_seconds / STARTUP_PROBE_PERIOD_S) + 1},
        "livenessProbe": {"httpGet": {"path": "/health_generate", "port": "http"},
                          "periodSeconds": max(1, math.ceil(health.interval_seconds)),
                          "timeoutSeconds": max(1, math.ceil(health.timeout_seconds)),
                          "failureThreshold": health.failure_threshold, "successThreshold": 1},
    }


def build_engine_pod(fleet: dict, slot: int, *, restarts: int = 0, rlfleet_image: str = DEFAULT_RLFLEET_IMAGE,
                     spec: FleetSpec | None = None) -> dict:
    """The pod of one engine slot: `<fleet>-engine-<slot>`, running the one SGLang command builder.

    The engine binds the pod's own address (`$(POD_IP)`). A `tiny://` model is written by an init
    container (rlfleet image) into a per-pod directory of the snapshot volume, so no two pods write
    the same files.
    """
    spec = spec or fleet_spec(fleet)
    eng: EngineSpec = spec.engine
    fname = fleet["metadata"]["name"]
    mount_path = spec.snapshots.mount_path if spec.snapshots else DEFAULT_MOUNT_PATH
    # The orchestrator's pin (fleet status), only when it lies on the fleet's own snapshot claim.
    pin = pinned_snapshot(fleet.get("status"), spec.snapshots.mount_path if spec.snapshots else None)
    model_path, weight_version = pin or (eng.model_path, "0")
    init_containers: list[dict] = []
    volumes: list[dict] = []
    mounts: list[dict] = []
    engine_mounts: list[dict] = []
    if spec.snapshots:
        # Read-only: no engine can rewrite the snapshots the others (and the trainer) load.
        volumes.append({"name": SNAPSHOT_VOLUME, "persistentVolumeClaim": {"claimName": spec.snapshots.claim_name,
                                                                           "readOnly": True}})
        mounts.append({"name": SNAPSHOT_VOLUME, "mountPath": mount_path})
        engine_mounts.append({"name": SNAPSHOT_VOLUME, "mountPath": mount_path, "readOnly": True})
    # A fleet's modelPath is not pattern-checked: a malformed tiny:// path is served as given, and the
    # engine's own error (in the fleet's Failed condition) says what is wrong with it.
    tiny = match_tiny_model(model_path)
    if tiny:
        if spec.snapshots:
            # The init container writes the model into the claim: that volume is mounted writable
            # (for the init container only; the engine's mount stays read-only).
            volumes[-1]["persistentVolumeClaim"].pop("readOnly")
        else:
            volumes.append({"name": SNAPSHOT_VOLUME, "emptyDir": {}})
            mounts.append({"name": SNAPSHOT_VOLUME, "mountPath": mount_path})
            engine_mounts.append({"name": SNAPSHOT_VOLUME, "mountPath": mount_path, "readOnly": True})
        model_path = f"{mount_path}/models/$(POD_NAME)/{tiny.cache_name}"
        init_containers.append(_secure({
            "name": "tiny-model",
            "image": rlfleet_image,
            "command": ["rlfleet", "tiny-model", model_path, "--seed", str(tiny.seed), "--arch", tiny.arch],
            "env": _downward_env(),
            "volumeMounts": mounts,
            **_TERMINATION,
        }))
    launch = build_engine_launch(eng, host="$(POD_IP)", model_path=model_path, weight_version=weight_version,
                                 api_key=f"$({API_KEY_ENV})")
    gpus = eng.gpus_per_engine if eng.device == "cuda" else 0
    if eng.device == "cuda":
        # NCCL and the engine's worker processes need more shared memory than the default 64 MiB.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        engine_mounts = [*engine_mounts, {"name": "dshm", "mountPath": "/dev/shm"}]
    container = _secure({
        "name": ENGINE_CONTAINER,
        "image": eng.image,
        "command": launch.argv("python3"),
        # Downward API first: $(POD_IP) in the command refers to it.
        "env": _downward_env() + [api_key_env(fname)]
        + _env({ReservedEnv.FLEET: fname, ReservedEnv.SLOT: str(slot)}) + _user_env(launch.env, eng.env),
        "ports": [{"name": "http", "containerPort": eng.port, "protocol": "TCP"}],
        # /health generates one token (up to 20 s on a busy engine): allow it before counting a failure.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                           "timeoutSeconds": 25, "failureThreshold": 3, "successThreshold": 1},
        "resources": _resources(eng.resources, gpus),
        "volumeMounts": engine_mounts,
        **_TERMINATION,
    })
    run = owning_run(fleet, spec)
    if run is None:
        container.update(engine_liveness(spec.health))
    pod_spec: dict[str, Any] = {
        # The operator, not the kubelet, restarts engines: within a budget, with backoff, counted.
        "restartPolicy": "Never",
        "securityContext": dict(POD_SECURITY),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if eng.node_selector:
        pod_spec["nodeSelector"] = dict(eng.node_selector)
    if eng.tolerations:
        pod_spec["tolerations"] = _tolerations(eng.tolerations)
    pod_labels = engine_labels(fname, slot)
    if run:
        pod_labels[LABEL_RUN] = run
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(engine_pod_name(fname, slot), fleet, pod_labels,
                          {ANN_RESTARTS: str(restarts), ANN_ENGINE_SPEC: engine_spec_digest(spec)}),
        "spec": pod_spec,
    }


# Router ----------------------------------------------------------------------------------------------
def _router_command(router: RouterSpec) -> list[str]:
    args = build_router_args(host="$(POD_IP)", port=router.port, metrics_port=ROUTER_METRICS_PORT,
                             health_interval_s=router.health_check_interval_seconds,
                             health_failure_threshold=router.health_failure_threshold,
                             api_key=f"$({API_KEY_ENV})", policy=router.policy)
    return ["python3", *args]


def follows_engine_pods(fleet: dict, spec: FleetSpec) -> bool:
    """Who keeps a fleet's router to its engines: a run's trainer registers the engines that serve its
    weights; for a fleet of no run, a follower beside the router routes to its Ready engine pods."""
    return owning_run(fleet, spec) is None


def _engine_follower(fleet: dict, spec: FleetSpec, image: str) -> dict:
    """`rlfleet follow-engines` (orchestrator/fleet/engine_follower.py) in the router pod of a fleet of no run."""
    meta = fleet["metadata"]
    return _secure({
        "name": "engine-follower",
        "image": image,
        "command": ["rlfleet", "follow-engines", "--namespace", meta["namespace"], "--fleet", meta["name"],
                    "--fleet-uid", meta["uid"], "--engine-port", str(spec.engine.port),
                    "--router", f"http://$({ReservedEnv.POD_IP}):{spec.router.port}",
                    "--health-host", f"$({ReservedEnv.POD_IP})", "--health-port", str(FOLLOWER_HEALTH_PORT)],
        "env": [*_downward_env(), api_key_env(meta["name"])],
        "ports": [{"name": "follower", "containerPort": FOLLOWER_HEALTH_PORT, "protocol": "TCP"}],
        # Unready while it cannot keep the router's workers (no account, router down): the pod shows 1/2.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "follower"}, "periodSeconds": 5,
                           "timeoutSeconds": 5, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "10m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}},
        **_TERMINATION,
    })


def build_router_deployment(fleet: dict, spec: FleetSpec | None = None, *,
                            follower_image: str = DEFAULT_OPERATOR_IMAGE) -> dict:
    """One sglang-router replica in front of the fleet. A run's trainer drives its membership; in the router
    pod of a fleet of no run, `engine-follower` does (with the `rlfleet-router` account: it reads pods)."""
    spec = spec or fleet_spec(fleet)
    fname = fleet["metadata"]["name"]
    labels = router_labels(fname)
    router = _secure({
        "name": ROUTER_CONTAINER,
        "image": spec.router.image,
        "command": _router_command(spec.router),
        "env": [*_downward_env(), api_key_env(fname)],
        "ports": [{"name": "http", "containerPort": spec.router.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                           "timeoutSeconds": 5, "failureThreshold": 3},
        **_TERMINATION,
    })
    if follows_engine_pods(fleet, spec):
        containers = [router, _engine_follower(fleet, spec, follower_image)]
        account: dict[str, Any] = {"serviceAccountName": ROUTER_SERVICE_ACCOUNT, "automountServiceAccountToken": True}
    else:
        containers, account = [router], {"automountServiceAccountToken": False}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(router_name(fname), fleet, labels),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {LABEL_COMPONENT: "router", LABEL_FLEET: fname}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {**account, "enableServiceLinks": False, "securityContext": dict(POD_SECURITY),
                         "terminationGracePeriodSeconds": 10, "containers": containers},
            },
        },
    }


def build_router_service(fleet: dict, spec: FleetSpec | None = None) -> dict:
    spec = spec or fleet_spec(fleet)
    fname = fleet["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(router_name(fname), fleet, router_labels(fname)),
        "spec": {
            "selector": {LABEL_COMPONENT: "router", LABEL_FLEET: fname},
            "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"},
                      {"name": "metrics", "port": ROUTER_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }


# Engine NetworkPolicy ---------------------------------------------------------------------------------
NETWORK_POLICY_COMPONENT = "engine-network-policy"
PEER_SELECTORS = ("namespaceSelector", "podSelector")


def network_policy_labels(fleet_name: str) -> dict[str, str]:
    return {LABEL_NAME: "rlfleet", LABEL_COMPONENT: NETWORK_POLICY_COMPONENT, LABEL_MANAGED_BY: MANAGER,
            LABEL_FLEET: fleet_name}


def network_peers(value: Any) -> list[dict]:
    """Validate NetworkPolicy `from` peers given as config (namespaceSelector and/or podSelector each).

    Returns them in the form the API server stores (empty matchLabels/matchExpressions dropped), so
    the policy read back equals the built one and is never patched for nothing. Raises ValueError.
    """
    if not isinstance(value, list):
        raise ValueError(f"peers must be a list of objects, got {type(value).__name__}")
    out = []
    for i, peer in enumerate(value):
        if not isinstance(peer, dict) or not peer:
            raise ValueError(f"peer {i}: must be an object with namespaceSelector and/or podSelector")
        unknown = set(peer) - set(PEER_SELECTORS)
        if unknown:
            raise ValueError(f"peer {i}: unknown field(s) {sorted(unknown)}; allowed: {list(PEER_SELECTORS)}")
        clean = {}
        for key, sel in peer.items():
            if not isinstance(sel, dict) or set(sel) - {"matchLabels", "matchExpressions"}:
                raise ValueError(f"peer {i}: {key} must be a label selector (matchLabels, matchExpressions)")
            labels = sel.get("matchLabels") or {}
            if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
                raise ValueError(f"peer {i}: {key}.matchLabels must map label names to strings")
            exprs = sel.get("matchExpressions") or []
            if not isinstance(exprs, list):
                raise ValueError(f"peer {i}: {key}.matchExpressions must be a list")
            clean[key] = {k: v for k, v in (("matchLabels", labels), ("matchExpressions", exprs)) if v}
        out.append(clean)
    return out


def build_engine_network_policy(fleet: dict, *, metrics_from: Sequence[dict] = (),
                                spec: FleetSpec | None = None) -> dict:
    """Ingress to the fleet's engine pods only from its router pods and the run's trainer pod.

    The engines' HTTP port serves admin endpoints (/update_weights_from_disk, /pause_generation,
    /abort_request, ...), so nothing else may reach them. The router needs the HTTP port only; the
    trainer drives weight sync and health probes, and in NCCL mode the broadcast group connects on
    ports of its own, so it may reach any port. A fleet of no run admits pods labelled
    `rlfleet.io/client: "true"` in its namespace instead of a trainer. `metrics_from` (peers, e.g.
    Prometheus) may reach the HTTP port, where SGLang serves /metrics. Egress is not restricted.
    """
    spec = spec or fleet_spec(fleet)
    fname = fleet["metadata"]["name"]
    http = [{"port": spec.engine.port, "protocol": "TCP"}]
    router = {"podSelector": {"matchLabels": {LABEL_COMPONENT: "router", LABEL_FLEET: fname}}}
    ingress: list[dict] = [{"from": [router], "ports": http}]
    if run := owning_run(fleet, spec):
        trainer = {LABEL_COMPONENT: "trainer", LABEL_RUN: run}
        ingress.append({"from": [{"podSelector": {"matchLabels": trainer}}]})
    else:
        ingress.append({"from": [{"podSelector": {"matchLabels": {LABEL_CLIENT: "true"}}}], "ports": http})
    if metrics_from:
        ingress.append({"from": [dict(p) for p in metrics_from], "ports": http})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(network_policy_name(fname), fleet, network_policy_labels(fname)),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_COMPONENT: "engine", LABEL_FLEET: fname}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


# Router NetworkPolicy and the fleet's API key -------------------------------------------------------------
ROUTER_NETWORK_POLICY_COMPONENT = "router-network-policy"


def router_network_policy_labels(fleet_name: str) -> dict[str, str]:
    return {**network_policy_labels(fleet_name), LABEL_COMPONENT: ROUTER_NETWORK_POLICY_COMPONENT}


def build_router_network_policy(fleet: dict, *, metrics_from: Sequence[dict] = (),
                                spec: FleetSpec | None = None) -> dict:
    """Ingress to the fleet's router pods only from the run's trainer pod (its HTTP port).

    The router's HTTP port serves `POST /workers` and `DELETE /workers/{id}`: whoever reaches it
    (and holds the key) could register a fake engine or drain the fleet. A fleet of no run admits pods
    labelled `rlfleet.io/client: "true"` in its namespace instead. `metrics_from` peers (e.g.
    Prometheus) may reach the router's metrics port. Egress is not restricted.
    """
    spec = spec or fleet_spec(fleet)
    fname = fleet["metadata"]["name"]
    http = [{"port": spec.router.port, "protocol": "TCP"}]
    if run := owning_run(fleet, spec):
        client = {LABEL_COMPONENT: "trainer", LABEL_RUN: run}
    else:
        client = {LABEL_CLIENT: "true"}
    ingress: list[dict] = [{"from": [{"podSelector": {"matchLabels": client}}], "ports": http}]
    if metrics_from:
        ingress.append({"from": [dict(p) for p in metrics_from],
                        "ports": [{"port": ROUTER_METRICS_PORT, "protocol": "TCP"}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(router_network_policy_name(fname), fleet, router_network_policy_labels(fname)),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_COMPONENT: "router", LABEL_FLEET: fname}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def api_key_labels(fleet_name: str) -> dict[str, str]:
    return {LABEL_NAME: "rlfleet", LABEL_COMPONENT: "api-key", LABEL_MANAGED_BY: MANAGER, LABEL_FLEET: fleet_name}


def build_api_key_secret(owner: dict, fleet_name: str, api_key: str) -> dict:
    """The Secret `<fleet>-api-key` holding the key the fleet's engines and router require.

    Owned by `owner`: the run for its fleets (created before them, so the trainer and every engine
    find it at start, with one key for both of the run's fleets), the fleet itself otherwise.
    `api_key` comes from the caller (rlfleet.sglang.http.new_api_key): the builder stays pure.
    """
    # Immutable: whoever may patch Secrets cannot swap the key under running engines.
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": _meta(api_key_secret_name(fleet_name), owner, api_key_labels(fleet_name)),
            "stringData": {API_KEY_SECRET_KEY: api_key}}


# TrainingRun children --------------------------------------------------------------------------------
def run_labels(run_name: str, component: str) -> dict[str, str]:
    return {LABEL_NAME: "rlfleet", LABEL_COMPONENT: component, LABEL_MANAGED_BY: MANAGER, LABEL_RUN: run_name}


def _run_child(run: dict, kind: str, name: str, component: str, spec: Any) -> dict:
    return {"apiVersion": API_VERSION, "kind": kind,
            "metadata": _meta(name, run, run_labels(run["metadata"]["name"], component)), "spec": spec}


def build_snapshot_pvc(run: dict, spec: TrainingRunSpec | None = None) -> dict | None:
    """The run's ReadWriteMany snapshot claim, or None when the run names an existing claim."""
    spec = spec or run_spec(run)
    vol = spec.weight_sync.snapshot_volume
    if vol.claim_name:
        return None
    claim: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": vol.size}}}
    if vol.storage_class_name:
        claim["storageClassName"] = vol.storage_class_name
    name = run["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(snapshot_claim_name(name, spec), run, run_labels(name, "snapshots")), "spec": claim}


def build_rollout_fleet(run: dict, spec: TrainingRunSpec | None = None) -> dict:
    """The run's RolloutFleet: `derive.rollout_fleet_spec` (the engine model defaults to the run's)."""
    spec = spec or run_spec(run)
    name = run["metadata"]["name"]
    return _run_child(run, "RolloutFleet", rollout_fleet_name(name), "rollout-fleet",
                      wire_dump(rollout_fleet_spec(name, spec)))


def build_eval_fleet(run: dict, spec: TrainingRunSpec | None = None) -> dict | None:
    """The run's EvalFleet (posture fleet only): `derive.eval_fleet_spec`, the rollout engine with the
    eval overrides."""
    spec = spec or run_spec(run)
    name = run["metadata"]["name"]
    fleet = eval_fleet_spec(name, spec)
    if fleet is None:
        return None
    return _run_child(run, "EvalFleet", eval_fleet_name(name), "eval-fleet", wire_dump(fleet))


def trainer_command(run: dict, *, resume: bool = False) -> list[str]:
    """`rlfleet run --kubernetes`: the orchestrator and trainer of this run, inside the cluster;
    `resume`: from the newest complete checkpoint on the run's claim (a recreated trainer pod)."""
    meta = run["metadata"]
    return ["rlfleet", "run", "--kubernetes", "--namespace", meta["namespace"], "--training-run", meta["name"],
            *(["--resume"] if resume else [])]


def _trainer_resources(spec: TrainingRunSpec) -> dict:
    """A trainer pod's resources: one GPU per rank (`gpus` per node), or on CPU a core per rank of the
    pod unless `resources.requests.cpu` says otherwise (the pod runs all of its ranks), never above a
    `resources.limits.cpu` (the API server refuses a request over its limit)."""
    trainer = spec.trainer
    resources = trainer.resources
    local = trainer.ranks_per_node
    if trainer.gpus == 0 and local > 1 and "cpu" not in resources.requests:
        limit = resources.limits.get("cpu")
        limit_cores = quantity(limit) if limit is not None else None
        request = limit if limit is not None and limit_cores is not None and limit_cores < local else str(local)
        resources = resources.model_copy(update={"requests": {**resources.requests, "cpu": request}})
    return _resources(resources, trainer.gpus)


def build_trainer_pods(run: dict, spec: TrainingRunSpec | None = None, *, restarts: int = 0,
                       nodes: Sequence[int] | None = None, rlfleet_image: str = DEFAULT_RLFLEET_IMAGE) -> list[dict]:
    """The trainer's pods: one `<run>-trainer` (spec.trainer.nodes 1), or the group `<run>-trainer-<i>`,
    one per node (`nodes`: only these node ranks; default all), all of incarnation `restarts`."""
    spec = spec or run_spec(run)
    count = spec.trainer.nodes
    return [build_trainer_pod(run, spec, restarts=restarts, node=i, rlfleet_image=rlfleet_image)
            for i in (range(count) if nodes is None else nodes)]


def build_trainer_pod(run: dict, spec: TrainingRunSpec | None = None, *, restarts: int = 0, node: int = 0,
                      rlfleet_image: str = DEFAULT_RLFLEET_IMAGE) -> dict:
    """A trainer pod: the orchestrator drives the fleets through the API (its own ServiceAccount).

    `restarts`: its incarnation (0: the first pod; n: the n-th recreation after a failure, which
    resumes from the newest complete checkpoint when the run writes checkpoints). `node`: its node rank
    in a trainer group (spec.trainer.nodes > 1; in $RLFLEET_TRAINER_NODE); its ranks meet pod 0's on the
    rendezvous port, and only pod 0 (rank 0: the orchestrator) serves the update group. `rlfleet_image`: the
    operator's trainer image, for a spec that names none."""
    spec = spec or run_spec(run)
    name = run["metadata"]["name"]
    trainer = spec.trainer
    if not 0 <= node < trainer.nodes:
        raise ValueError(f"trainer node {node} is outside spec.trainer.nodes {trainer.nodes}")
    group = trainer.nodes > 1
    mount_path = spec.weight_sync.mount_path
    env = _downward_env() + [api_key_env(rollout_fleet_name(name))] + _env({
        ReservedEnv.TRAINING_RUN: name,
        ReservedEnv.SNAPSHOT_DIR: mount_path,
        **({ReservedEnv.TRAINER_NODE: str(node)} if group else {}),
    }) + _user_env({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}, trainer.env) + _wandb_api_key_env(spec)
    ports = [{"name": "metrics", "containerPort": spec.metrics_port, "protocol": "TCP"}]
    if node == 0:
        ports += _update_group_ports(spec)
        if group:
            ports.append({"name": TRAINER_RENDEZVOUS_PORT_NAME, "containerPort": TRAINER_RENDEZVOUS_PORT,
                          "protocol": "TCP"})
    container = _secure({
        "name": "trainer",
        "image": trainer.image or rlfleet_image,
        "command": trainer_command(run, resume=restarts > 0 and spec.checkpoint is not None),
        "env": env,
        "ports": ports,
        "resources": _trainer_resources(spec),
        "volumeMounts": [{"name": SNAPSHOT_VOLUME, "mountPath": mount_path}],
        **_TERMINATION,
    })
    pod_spec: dict[str, Any] = {
        # The operator, not the kubelet, recreates a failed trainer (spec.trainer.maxRestarts, with backoff);
        # the reason is in the termination message.
        "restartPolicy": "Never",
        # fsGroup: the non-root trainer can write a fresh claim.
        "securityContext": dict(POD_SECURITY),
        "serviceAccountName": TRAINER_SERVICE_ACCOUNT,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": [{"name": SNAPSHOT_VOLUME,
                     "persistentVolumeClaim": {"claimName": snapshot_claim_name(name, spec)}}],
    }
    if trainer.node_selector:
        pod_spec["nodeSelector"] = dict(trainer.node_selector)
    if trainer.tolerations:
        pod_spec["tolerations"] = _tolerations(trainer.tolerations)
    labels = run_labels(name, "trainer")
    if group:
        labels[LABEL_TRAINER_NODE] = str(node)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": _meta(trainer_pod_name(name, node if group else None), run, labels,
                              {ANN_RESTARTS: str(restarts)}),
            "spec": pod_spec}


WANDB_API_KEY_ENV = "WANDB_API_KEY"  # the W&B client's own variable


def _wandb_api_key_env(spec: TrainingRunSpec) -> list[dict]:
    """spec.tracking.wandb.apiKey: $WANDB_API_KEY of the trainer, from the user's Secret (last, so that it
    is the one that counts)."""
    wandb = spec.tracking.wandb if spec.tracking is not None else None
    if wandb is None or wandb.api_key is None:
        return []
    return [{"name": WANDB_API_KEY_ENV, "valueFrom": {"secretKeyRef": wire_dump(wandb.api_key.secret_key_ref)}}]


def trainer_pod_node(pod: dict) -> int:
    """A trainer pod's node rank (its label; a trainer of one node has none: 0)."""
    try:
        return int(((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_TRAINER_NODE, "0"))
    except ValueError:
        return -1


def _update_group_ports(spec: TrainingRunSpec) -> list[dict]:
    """Broadcast weight sync: the trainer's orchestrator is rank 0 of the update group, on its pod IP."""
    if spec.weight_sync.mode != "broadcast":
        return []
    return [{"name": UPDATE_GROUP_PORT_NAME, "containerPort": UPDATE_GROUP_PORT, "protocol": "TCP"}]


# Broadcast weight sync: the update group's NetworkPolicies ----------------------------------------------
UPDATE_GROUP_NETWORK_POLICY_COMPONENT = "update-group-network-policy"


def update_group_network_policy_labels(run_name: str) -> dict[str, str]:
    return {**run_labels(run_name, UPDATE_GROUP_NETWORK_POLICY_COMPONENT)}


def build_trainer_network_policies(run: dict, spec: TrainingRunSpec | None = None) -> list[dict]:
    """The NetworkPolicies of the trainer's pods, owned by the run: none for a trainer of one pod in
    disk mode (nothing connects to it but metrics scrapes).

    - `<run>-trainer` selects the trainer's pods and admits: the run's rollout engines to the update-group
      port and the ephemeral range (broadcast: pod 0's rank 0 is rank 0 of the update group; its TCP
      store is on that port, the collective's own connections, gloo pairs or NCCL sockets, go either way
      on ports the kernel picks); the trainer's own pods to the rendezvous port and the ephemeral range (a
      trainer group, spec.trainer.nodes > 1: every launcher meets pod 0's store, every rank pairs with
      every other over gloo/NCCL); anyone to the metrics port, as without a policy; nothing else;
    - `<run>-update-group` (broadcast) selects the rollout engines: they may reach each other on the
      ephemeral range (their fleet's `<fleet>-engines` policy already admits the trainer on every port).
    """
    spec = spec or run_spec(run)
    broadcast = spec.weight_sync.mode == "broadcast"
    group = spec.trainer.nodes > 1
    if not broadcast and not group:
        return []
    name = run["metadata"]["name"]
    engines = {"podSelector": {"matchLabels": {LABEL_COMPONENT: "engine", LABEL_FLEET: rollout_fleet_name(name)}}}
    collective = {"port": COLLECTIVE_PORTS[0], "endPort": COLLECTIVE_PORTS[1], "protocol": "TCP"}
    labels = update_group_network_policy_labels(name)

    def policy(policy_name: str, selected: dict, ingress: list[dict]) -> dict:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": _meta(policy_name, run, labels),
                "spec": {"podSelector": selected, "policyTypes": ["Ingress"], "ingress": ingress}}

    trainer = {"matchLabels": {LABEL_COMPONENT: "trainer", LABEL_RUN: name}}
    ingress: list[dict] = []
    if broadcast:
        ingress.append({"from": [engines], "ports": [{"port": UPDATE_GROUP_PORT, "protocol": "TCP"}, collective]})
    if group:
        ingress.append({"from": [{"podSelector": trainer}],
                        "ports": [{"port": TRAINER_RENDEZVOUS_PORT, "protocol": "TCP"}, collective]})
    ingress.append({"ports": [{"port": spec.metrics_port, "protocol": "TCP"}]})
    policies = [policy(trainer_network_policy_name(name), trainer, ingress)]
    if broadcast:
        policies.append(policy(update_group_network_policy_name(name), engines["podSelector"],
                               [{"from": [engines], "ports": [collective]}]))
    return policies


# The trainer's account ---------------------------------------------------------------------------------
# What a trainer pod may do (the chart's templates/workload-rbac.yaml renders the same rules): read its
# fleets, their pods and its run; write only their status (the orchestrator's marks, progress, failure).
# No pod, no spec: the trainer pod runs code the run's author chooses.
TRAINER_RULES: tuple[dict, ...] = (
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [GROUP], "resources": ["rolloutfleets", "evalfleets", "trainingruns"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": [GROUP], "resources": ["rolloutfleets/status", "evalfleets/status", "trainingruns/status"],
     "verbs": ["get", "patch"]},
    # Router pods are found through their owners (fleet -> Deployment -> ReplicaSet).
    {"apiGroups": ["apps"], "resources": ["deployments", "replicasets"], "verbs": ["get", "list"]},
)


# What a fleet of no run's router pod may do (templates/workload-rbac.yaml renders the same): read pods, for
# its engine follower. Nothing else: the pod's token is also in the network-facing router container.
ROUTER_RULES: tuple[dict, ...] = (
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
)


def _namespace_account(namespace: str, name: str, component: str, rules: Sequence[dict]) -> list[dict]:
    """A ServiceAccount with its Role and RoleBinding (all `name`), shared by the pods of the namespace
    that use it, so owned by none of them (deleting a run or a fleet leaves them)."""
    labels = {LABEL_NAME: "rlfleet", LABEL_COMPONENT: component, LABEL_MANAGED_BY: MANAGER}
    meta = {"name": name, "namespace": namespace, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": [dict(r) for r in rules]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]


def build_trainer_rbac(namespace: str) -> list[dict]:
    """The trainer's ServiceAccount, Role and RoleBinding in a run's namespace (all `rlfleet-trainer`)."""
    return _namespace_account(namespace, TRAINER_SERVICE_ACCOUNT, "trainer-rbac", TRAINER_RULES)


def build_router_rbac(namespace: str) -> list[dict]:
    """The account of fleet-of-no-run routers in the fleet's namespace (all `rlfleet-router`)."""
    return _namespace_account(namespace, ROUTER_SERVICE_ACCOUNT, "router-rbac", ROUTER_RULES)
