"""Kopf handlers of the rlfleet operator: thin glue between Kopf and `reconcile`.

Level-based: one daemon per TrainingRun, RolloutFleet and EvalFleet runs a loop that derives
everything from the cluster (indexes of the operator's pods, routers, claims and fleets, fed by Kopf's
watches) and writes at most one status per pass (two when a child is refused). Children are matched
by the owner's UID in their controller ownerReference, never by labels alone. Watch events of the
object or of its children only wake the loop early; a pass also runs every RESYNC_S seconds and whenever a backoff ends.

State that must survive a restart of the operator lives in the cluster (fleet status and pod
annotations, see `fleet_decide`), never only in memory; two replicas are safe with Kopf peering
(only the highest-priority one is active).

The dead mark: the orchestrator (whose ServiceAccount may patch no pod and no spec) marks a slot's
pod dead in the fleet's `status.orchestrator.engines` (`rlfleet.kube.marks`); the operator then
recreates the slot within the fleet's restart budget and backoff.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import kopf
from pydantic import ValidationError

from rlfleet.crds import GROUP, VERSION
from rlfleet.kube.client import ApiError, KubeClient
from rlfleet.kube.ownership import partition
from rlfleet.observability import metrics
from rlfleet.operator import builders as b
from rlfleet.operator.fleet_decide import FleetPlan
from rlfleet.operator.reconcile import (
    ChildrenRefused,
    Settings,
    compact_pod,
    plain,
    reconcile_fleet,
    reconcile_run,
)
from rlfleet.operator.run_decide import RunChildren, RunPlan
from rlfleet.operator.staleness import STALE_RETRY_S, STALE_WAIT_MAX_S, LeftBehind

log = logging.getLogger("rlfleet.operator")

RESYNC_S = 30.0
ERROR_BACKOFF_S = (1, 2, 5, 10, 30)
DEBOUNCE_S = 0.05  # let a burst of watch events (one pod created -> several updates) settle first
MANAGED = {b.LABEL_MANAGED_BY: b.MANAGER}
EXPECTED_ERRORS = (ApiError, ValidationError, ChildrenRefused)


# Startup ---------------------------------------------------------------------------------------------
@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    settings.posting.reporting_component = b.MANAGER
    settings.persistence.finalizer = f"{b.GROUP}/operator"
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    # Stream only the operator's own children, not every pod of the cluster.
    for plural in ("pods", "deployments", "services", "persistentvolumeclaims", "networkpolicies"):
        settings.watching.label_selectors[plural] = f"{b.LABEL_MANAGED_BY}={b.MANAGER}"
    # Least privilege: no cluster-wide CRD/namespace scanning; the namespaces are given on the command line.
    settings.scanning.disabled = True
    memo.setdefault("triggers", {})
    memo.setdefault("foreign_reported", set())  # UIDs of foreign children already reported by an Event
    memo.setdefault("settings", Settings())
    if "kube" not in memo:
        memo.kube = await KubeClient.load(memo.get("kubeconfig"))
    memo.kube.on_request = lambda verb: metrics.OPERATOR_API_REQUESTS.labels(verb=verb).inc()


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_) -> None:
    kube = memo.get("kube")
    if kube is not None:
        await kube.close()


@kopf.on.login()
def login(memo: kopf.Memo, **kwargs):
    if memo.get("kubeconfig"):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.probe(id="reconcilers")
def probe_reconcilers(memo: kopf.Memo, **_) -> int:
    return len(memo.get("triggers", {}))


# Indexes (in-memory views of the operator's children, fed by Kopf's watches) --------------------------
@kopf.index("pods", labels={b.LABEL_COMPONENT: "engine", b.LABEL_FLEET: kopf.PRESENT})
def engine_pods(body, namespace, labels, **_):
    return {(namespace, labels[b.LABEL_FLEET]): compact_pod(body)}


@kopf.index("pods", labels={b.LABEL_COMPONENT: "trainer", b.LABEL_RUN: kopf.PRESENT})
def trainer_pods(body, namespace, labels, **_):
    return {(namespace, labels[b.LABEL_RUN]): compact_pod(body)}


@kopf.index("deployments", labels={b.LABEL_COMPONENT: "router", b.LABEL_FLEET: kopf.PRESENT})
def router_deployments(body, namespace, labels, **_):
    return {(namespace, labels[b.LABEL_FLEET]): _identity_and_spec(body)}


def _identity_and_spec(body) -> dict:
    """What a reconcile compares of a child: who it is (to delete the right one) and its spec."""
    meta = body.get("metadata", {})
    keep = {k: meta.get(k) for k in ("name", "namespace", "uid", "deletionTimestamp", "ownerReferences")
            if meta.get(k) is not None}
    return plain({"metadata": keep, "spec": body.get("spec")})


@kopf.index("services", labels={b.LABEL_COMPONENT: "router", b.LABEL_FLEET: kopf.PRESENT})
def router_services(body, namespace, labels, **_):
    return {(namespace, labels[b.LABEL_FLEET]): _identity_and_spec(body)}


def _fleet_policy(labels, **_) -> bool:
    return labels.get(b.LABEL_COMPONENT) in (b.NETWORK_POLICY_COMPONENT, b.ROUTER_NETWORK_POLICY_COMPONENT)


@kopf.index("networking.k8s.io", "v1", "networkpolicies", labels={b.LABEL_FLEET: kopf.PRESENT}, when=_fleet_policy)
def network_policies(body, namespace, labels, **_):
    """A fleet's engine and router NetworkPolicies, keyed by (namespace, fleet, component)."""
    return {(namespace, labels[b.LABEL_FLEET], labels[b.LABEL_COMPONENT]): _identity_and_spec(body)}


@kopf.index("networking.k8s.io", "v1", "networkpolicies",
            labels={b.LABEL_COMPONENT: b.UPDATE_GROUP_NETWORK_POLICY_COMPONENT, b.LABEL_RUN: kopf.PRESENT})
def update_group_policies(body, namespace, labels, **_):
    """A broadcast run's update-group NetworkPolicies, keyed by (namespace, run)."""
    return {(namespace, labels[b.LABEL_RUN]): _identity_and_spec(body)}


@kopf.index("persistentvolumeclaims", labels={b.LABEL_COMPONENT: "snapshots", b.LABEL_RUN: kopf.PRESENT})
def snapshot_claims(body, namespace, labels, **_):
    return {(namespace, labels[b.LABEL_RUN]): plain(body)}


def _owned_by_run(spec, **_) -> bool:
    return bool(spec.get("runName"))


@kopf.index(GROUP, VERSION, "rolloutfleets", when=_owned_by_run)
def rollout_fleets(body, namespace, spec, **_):
    return {(namespace, spec["runName"]): plain(body)}


@kopf.index(GROUP, VERSION, "evalfleets", when=_owned_by_run)
def eval_fleets(body, namespace, spec, **_):
    return {(namespace, spec["runName"]): plain(body)}


# Wake-ups --------------------------------------------------------------------------------------------
def _wake(memo: kopf.Memo, kind: str, namespace: str | None, name: str | None) -> None:
    if namespace and name:
        event = memo.triggers.get((kind, namespace, name))
        if event is not None:
            event.set()


@kopf.on.event("pods", labels=MANAGED)
def pod_changed(namespace, labels, memo: kopf.Memo, **_) -> None:
    _wake(memo, "fleet", namespace, labels.get(b.LABEL_FLEET))
    if labels.get(b.LABEL_COMPONENT) == "trainer":
        _wake(memo, "run", namespace, labels.get(b.LABEL_RUN))


@kopf.on.event("deployments", labels=MANAGED)
@kopf.on.event("services", labels=MANAGED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=MANAGED)
def fleet_child_changed(namespace, labels, memo: kopf.Memo, **_) -> None:
    _wake(memo, "fleet", namespace, labels.get(b.LABEL_FLEET))


@kopf.on.event("networking.k8s.io", "v1", "networkpolicies",
               labels={**MANAGED, b.LABEL_COMPONENT: b.UPDATE_GROUP_NETWORK_POLICY_COMPONENT})
@kopf.on.event("persistentvolumeclaims", labels=MANAGED)
def run_child_changed(namespace, labels, memo: kopf.Memo, **_) -> None:
    _wake(memo, "run", namespace, labels.get(b.LABEL_RUN))


@kopf.on.event(GROUP, VERSION, "rolloutfleets")
@kopf.on.event(GROUP, VERSION, "evalfleets")
def fleet_changed(namespace, name, spec, memo: kopf.Memo, **_) -> None:
    _wake(memo, "fleet", namespace, name)
    _wake(memo, "run", namespace, spec.get("runName"))


@kopf.on.event(GROUP, VERSION, "trainingruns")
def run_changed(namespace, name, memo: kopf.Memo, **_) -> None:
    _wake(memo, "run", namespace, name)


# The reconcile loops ---------------------------------------------------------------------------------
async def _loop(key: tuple[str, str, str], kind: str, memo: kopf.Memo, stopped, body, once) -> None:
    """Reconcile now, then again on a wake-up, a requested time, or RESYNC_S; errors back off. A body
    that still shows a status this loop has already replaced waits for the newer one (staleness.py)."""
    trigger = memo.triggers.setdefault(key, asyncio.Event())
    loop = asyncio.get_running_loop()
    errors = 0
    left_behind: LeftBehind | None = None
    try:
        while not stopped:
            trigger.clear()
            started = time.monotonic()
            try:
                requeue: float | None
                if left_behind is not None and left_behind.puts_off(body["metadata"].get("resourceVersion"),
                                                                    loop.time()):
                    requeue = STALE_RETRY_S  # this loop's own newer status is on its way through the watch
                else:
                    plan = await once()
                    requeue = plan.requeue_after if plan is not None else None
                    left_behind = (LeftBehind(plan.superseded_versions, loop.time() + STALE_WAIT_MAX_S)
                                   if plan is not None and plan.superseded_versions else None)
                    errors = 0
                    metrics.OPERATOR_RECONCILES.labels(kind=kind, outcome="ok").inc()
            except Exception as e:
                requeue = ERROR_BACKOFF_S[min(errors, len(ERROR_BACKOFF_S) - 1)]
                errors += 1
                reason = f"api_{e.status}" if isinstance(e, ApiError) else type(e).__name__
                metrics.OPERATOR_RECONCILES.labels(kind=kind, outcome="error").inc()
                metrics.OPERATOR_RECONCILE_ERRORS.labels(kind=kind, reason=reason).inc()
                # Expected: the API server's answer, or a spec the typed models reject. Anything else
                # (a KeyError or ValueError included) is a bug of ours: log it with its traceback.
                expected = isinstance(e, EXPECTED_ERRORS)
                log.log(logging.WARNING if expected else logging.ERROR, "%s %s/%s: reconcile failed (retry in %ss): %s",
                        kind, key[1], key[2], requeue, e, exc_info=not expected)
            finally:
                metrics.OPERATOR_RECONCILE_DURATION.labels(kind=kind).observe(time.monotonic() - started)
            timeout = RESYNC_S if requeue is None else max(0.05, min(requeue, RESYNC_S))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancellation on 3.11
                    await trigger.wait()
            await asyncio.sleep(DEBOUNCE_S)
    finally:
        memo.triggers.pop(key, None)


async def _fleet_daemon(body, memo, stopped, engine_pods, router_deployments, router_services,
                        network_policies) -> None:
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    kind = body["kind"]

    async def once() -> FleetPlan | None:
        fleet = plain(body)  # the daemon's body is kept current by Kopf
        if fleet["metadata"].get("deletionTimestamp"):
            return None
        key, uid = (ns, name), fleet["metadata"]["uid"]
        # Children are the fleet's by its UID in their controller ownerReference, not by their labels.
        pods, foreign_pods = partition(_all(engine_pods, key), uid)
        deployments, foreign_deployments = partition(_all(router_deployments, key), uid)
        services, foreign_services = partition(_all(router_services, key), uid)
        policies, foreign_policies = partition(_all(network_policies, (*key, b.NETWORK_POLICY_COMPONENT)), uid)
        router_policies, foreign_router_policies = partition(
            _all(network_policies, (*key, b.ROUTER_NETWORK_POLICY_COMPONENT)), uid)
        foreign = [*(("Pod", o) for o in foreign_pods), *(("Deployment", o) for o in foreign_deployments),
                   *(("Service", o) for o in foreign_services),
                   *(("NetworkPolicy", o) for o in [*foreign_policies, *foreign_router_policies])]
        plan = await reconcile_fleet(
            memo.kube, fleet, pods, router_deployment=deployments[0] if deployments else None,
            router_service=bool(services), network_policy=policies[0] if policies else None,
            router_network_policy=router_policies[0] if router_policies else None,
            settings=memo.settings, foreign=foreign, reported=memo.foreign_reported)
        return plan

    await _loop(("fleet", ns, name), kind, memo, stopped, body, once)


# kopf passes the indices in as keyword arguments; its DaemonFn protocol cannot declare them.
@kopf.daemon(GROUP, VERSION, "rolloutfleets", cancellation_backoff=1.0,  # type: ignore[arg-type]  # indices, see above
             cancellation_timeout=10.0)
async def rolloutfleet_daemon(body, memo, stopped, engine_pods, router_deployments, router_services,
                              network_policies, **_):
    await _fleet_daemon(body, memo, stopped, engine_pods, router_deployments, router_services, network_policies)


# kopf passes the indices in as keyword arguments; its DaemonFn protocol cannot declare them.
@kopf.daemon(GROUP, VERSION, "evalfleets", cancellation_backoff=1.0,  # type: ignore[arg-type]  # indices, see above
             cancellation_timeout=10.0)
async def evalfleet_daemon(body, memo, stopped, engine_pods, router_deployments, router_services,
                           network_policies, **_):
    await _fleet_daemon(body, memo, stopped, engine_pods, router_deployments, router_services, network_policies)


def _all(index, key) -> list[dict]:
    return [plain(item) for item in index.get(key, [])]


def _owned_one(index, key, uid: str, kind: str, foreign: list[tuple[str, dict]]) -> dict | None:
    """The child under `key` that the owner `uid` controls; the others go to `foreign`."""
    owned, others = partition(_all(index, key), uid)
    foreign.extend((kind, o) for o in others)
    return owned[0] if owned else None


# kopf passes the indices in as keyword arguments; its DaemonFn protocol cannot declare them.
@kopf.daemon(GROUP, VERSION, "trainingruns", cancellation_backoff=1.0,  # type: ignore[arg-type]  # indices, see above
             cancellation_timeout=10.0)
async def trainingrun_daemon(body, memo, stopped, rollout_fleets, eval_fleets, trainer_pods, snapshot_claims,
                             update_group_policies, **_):
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]

    async def once() -> RunPlan | None:
        run = plain(body)
        if run["metadata"].get("deletionTimestamp"):
            return None
        key, uid = (ns, name), run["metadata"]["uid"]
        # A fleet with this runName, a pod labelled as this run's trainer: the run's only when it owns them.
        foreign: list[tuple[str, dict]] = []
        trainers, foreign_trainers = partition(_all(trainer_pods, key), uid)  # one pod, or a group's
        foreign.extend(("Pod", o) for o in foreign_trainers)
        children = RunChildren(rollout=_owned_one(rollout_fleets, key, uid, "RolloutFleet", foreign),
                               eval=_owned_one(eval_fleets, key, uid, "EvalFleet", foreign),
                               trainer=next((p for p in trainers if b.trainer_pod_node(p) == 0), None),
                               trainer_group=trainers,
                               pvc=_owned_one(snapshot_claims, key, uid, "PersistentVolumeClaim", foreign))
        policies, foreign_policies = partition(_all(update_group_policies, key), uid)
        children.update_group_policies = policies
        foreign.extend(("NetworkPolicy", o) for o in foreign_policies)
        plan = await reconcile_run(memo.kube, run, children, settings=memo.settings, foreign=foreign,
                                   reported=memo.foreign_reported)
        return plan  # its requeue_after: a trainer pod's backoff ends then

    await _loop(("run", ns, name), "TrainingRun", memo, stopped, body, once)
