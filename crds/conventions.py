"""The contract between the operator, the orchestrator and the node: names, labels, annotations.

Labels and annotations are API:

- engine pods carry `rlfleet.io/fleet`, `rlfleet.io/slot`, `app.kubernetes.io/component=engine`;
- `rlfleet.io/restarts` on an engine pod: the recreation number of the slot this pod embodies;
- the orchestrator (trainer pod) writes only status: dead marks, read-back weight versions and the
  snapshot replacements start from in a fleet's `status.orchestrator`, a run's failure in its
  `status.orchestratorFailure` (see `rlfleet.kube.marks`); it may patch no pod and no spec;
- `rlfleet.io/client: "true"` on a pod: it may call the engines of the fleets in its namespace that
  belong to no run (a run's engines admit only its router and trainer pods).
"""
from __future__ import annotations

from rlfleet.crds import API_VERSION, GROUP, VERSION

__all__ = ["API_VERSION", "GROUP", "VERSION"]

PLURALS = {"TrainingRun": "trainingruns", "RolloutFleet": "rolloutfleets", "EvalFleet": "evalfleets"}


LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_FLEET = f"{GROUP}/fleet"
LABEL_SLOT = f"{GROUP}/slot"
LABEL_RUN = f"{GROUP}/run"
LABEL_CLIENT = f"{GROUP}/client"
LABEL_TRAINER_NODE = f"{GROUP}/trainer-node"  # a trainer pod's node rank (0 for a trainer of one node)

ANN_RESTARTS = f"{GROUP}/restarts"
# A digest of the fleet spec an engine pod was built from (its engine, health and snapshots): a pod whose digest
# differs from the fleet's is replaced (fleets of no run; see operator/engine_update_decide.py).
ANN_ENGINE_SPEC = f"{GROUP}/engine-spec"

MANAGER = "rlfleet-operator"
ROUTER_METRICS_PORT = 29000
ROUTER_CONTAINER = "router"  # the router pod's sglang-router container (its restarts are the router's)
# A fleet of no run's engine follower (in its router pod) answers its readiness probe here.
FOLLOWER_HEALTH_PORT = 29001
ENGINE_CONTAINER = "engine"
TRAINER_SERVICE_ACCOUNT = "rlfleet-trainer"
ROUTER_SERVICE_ACCOUNT = "rlfleet-router"  # a fleet of no run's router: reads pods to discover its engines
DEFAULT_RLFLEET_IMAGE = "rlfleet/rlfleet:0.1.0"
# The light image (no torch, no SGLang) of the operator; it also runs a fleet of no run's engine follower.
DEFAULT_OPERATOR_IMAGE = "rlfleet/rlfleet-operator:0.1.0"
SNAPSHOT_VOLUME = "snapshots"
# Each fleet's engines and router require its API key (Bearer); it lives in the Secret
# `<fleet>-api-key` (key `api-key`), reaches containers as this environment variable.
API_KEY_ENV = "RLFLEET_API_KEY"
API_KEY_SECRET_KEY = "api-key"
# Pods the operator builds run as this non-root user and group (Pod Security `restricted`); fsGroup too,
# so the trainer can write a fresh snapshot claim and engines read what it wrote.
POD_USER_ID = 1000
# Broadcast weight sync on Kubernetes: the trainer pod's update-group rendezvous (rank 0's TCP store, on
# its pod IP) listens here (containerPort `update-group`). The collective's own connections (gloo pairs,
# NCCL sockets) use ports the kernel picks from its ephemeral range: the NetworkPolicies admit the run's
# engines to those ports of the trainer and of each other, and nothing else there.
UPDATE_GROUP_PORT = 29600
UPDATE_GROUP_PORT_NAME = "update-group"
COLLECTIVE_PORTS = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range
# A trainer group (spec.trainer.nodes > 1): every pod's rank launcher meets pod 0's (its TCP store, on pod
# 0's IP) on this port (containerPort `rendezvous`); the ranks' gloo/NCCL pairs use the ephemeral range.
TRAINER_RENDEZVOUS_PORT = 29500
TRAINER_RENDEZVOUS_PORT_NAME = "rendezvous"

def engine_pod_name(fleet_name: str, slot: int) -> str:
    return f"{fleet_name}-engine-{slot}"


def router_name(fleet_name: str) -> str:
    return f"{fleet_name}-router"


def rollout_fleet_name(run_name: str) -> str:
    return f"{run_name}-rollout"


def eval_fleet_name(run_name: str) -> str:
    return f"{run_name}-eval"


def trainer_pod_name(run_name: str, node: int | None = None) -> str:
    """`<run>-trainer` (a trainer of one node), or `<run>-trainer-<node>` (a pod of a trainer group)."""
    return f"{run_name}-trainer" if node is None else f"{run_name}-trainer-{node}"


def trainer_pod_names(run_name: str, nodes: int) -> list[str]:
    """The trainer's pods, by node: one `<run>-trainer`, or `<run>-trainer-0` .. `<run>-trainer-<nodes-1>`."""
    return [trainer_pod_name(run_name)] if nodes == 1 else [trainer_pod_name(run_name, i) for i in range(nodes)]


def engine_labels(fleet_name: str, slot: int | None = None) -> dict[str, str]:
    labels = {LABEL_NAME: "rlfleet", LABEL_COMPONENT: "engine", LABEL_MANAGED_BY: MANAGER, LABEL_FLEET: fleet_name}
    if slot is not None:
        labels[LABEL_SLOT] = str(slot)
    return labels


def engine_selector(fleet_name: str) -> str:
    """Label selector of a fleet's engine pods (also the scale subresource's selector)."""
    return f"{LABEL_COMPONENT}=engine,{LABEL_FLEET}={fleet_name}"


def network_policy_name(fleet_name: str) -> str:
    return f"{fleet_name}-engines"


def router_network_policy_name(fleet_name: str) -> str:
    return f"{fleet_name}-router"


def trainer_network_policy_name(run_name: str) -> str:
    return f"{run_name}-trainer"


def update_group_network_policy_name(run_name: str) -> str:
    return f"{run_name}-update-group"


def api_key_secret_name(fleet_name: str) -> str:
    return f"{fleet_name}-api-key"


def router_labels(fleet_name: str) -> dict[str, str]:
    return {LABEL_NAME: "rlfleet", LABEL_COMPONENT: "router", LABEL_MANAGED_BY: MANAGER, LABEL_FLEET: fleet_name}
