"""Apply one reconcile: decide (pure) from the observed objects, then make the API calls.

Order of writes per fleet reconcile: the status first (at most one write, skipped when unchanged),
because it records restart counts and failure times before any pod is deleted or created; then pod
deletions, creations, router objects, the engine NetworkPolicy and Events. A crash between the steps
leaves a state that the next reconcile, from the cluster alone, completes without counting anything twice.

A child the API server refuses (`rlfleet.kube.refusals`) is collected, not raised: the pass then writes
the status a second time, with the ChildRejected condition and the server's message (`rejections`),
posts one Warning Event, and raises `ChildrenRefused` for a refusal that clears by itself, so the loop
retries it with backoff. Answers that are not refusals (no answer, 429, 5xx) raise as before.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.crds import VERSION, reasons
from rlfleet.crds.conventions import PLURALS
from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.kube.client import (
    DEPLOYMENTS,
    EVENTS,
    NETWORK_POLICIES,
    PODS,
    PVCS,
    ROLE_BINDINGS,
    ROLES,
    SECRETS,
    SERVICEACCOUNTS,
    SERVICES,
    ApiError,
    KubeClient,
    Resource,
)
from rlfleet.kube.marks import ORCHESTRATOR
from rlfleet.kube.ownership import controller_uid
from rlfleet.kube.refusals import Rejection, rejection
from rlfleet.observability import metrics
from rlfleet.operator import builders as b
from rlfleet.operator import rejections
from rlfleet.operator.fleet_decide import (
    Event,
    FleetPlan,
    decide_fleet_actions,
    decide_network_policy,
    decide_router_deployment,
    unowned_run_name_events,
)
from rlfleet.operator.run_decide import OPERATOR_STATUS_KEYS, RunChildren, RunPlan, decide_run, owned_status
from rlfleet.operator.staleness import superseded
from rlfleet.operator.update_group_decide import decide_update_group_policies
from rlfleet.sglang.http import new_api_key
from rlfleet.util.redact import redact

log = logging.getLogger("rlfleet.operator")

def custom(plural: str) -> Resource:
    return Resource(b.GROUP, VERSION, plural)


TRAININGRUNS = custom(PLURALS["TrainingRun"])


@dataclass
class Settings:
    rlfleet_image: str = b.DEFAULT_RLFLEET_IMAGE
    follower_image: str = b.DEFAULT_OPERATOR_IMAGE
    instance: str = os.environ.get("POD_NAME", "rlfleet-operator")
    # Each fleet's engines admit only its router and trainer (NetworkPolicy `<fleet>-engines`).
    network_policy: bool = True
    # Peers (e.g. Prometheus) that may also reach the engines' HTTP port, where /metrics is served.
    network_policy_metrics_from: tuple[dict, ...] = ()
    # Create the trainer's account (ServiceAccount, Role, RoleBinding) in a run's namespace before its
    # trainer pod, and the router's before a fleet of no run's router (cluster-wide installs; a namespaced
    # chart creates both itself).
    workload_rbac: bool = False


async def _post_events(kube: KubeClient, obj: dict, events: list[Event], settings: Settings) -> None:
    meta = obj["metadata"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for ev in events:
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "type": ev.type, "reason": ev.reason, "message": redact(ev.message)[:1024],
            "source": {"component": b.MANAGER}, "reportingComponent": b.MANAGER,
            "reportingInstance": settings.instance, "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        try:
            await kube.create(EVENTS, body, meta["namespace"])
        except ApiError as e:  # an Event is best effort; the status holds the same facts
            log.warning("event %s on %s/%s: %s", ev.reason, meta["namespace"], meta["name"], e)


class ChildrenRefused(Exception):
    """Children refused for a reason that clears by itself (shown as Degraded): retry with backoff."""


async def _create(kube: KubeClient, res: Resource, obj: dict, refused: list[Rejection] | None = None, *,
                  readable: bool = True) -> bool:
    """Create; an object of ours that already exists (by name) is fine: that is how duplicates are
    prevented. A refusal goes to `refused` (when given), the server's message kept; a name held by an
    object its owner does not own is a refusal too (never adopted). `readable=False` (Secrets: the
    operator may create them, never read them): an existing namesake is kept as it is, unchecked."""
    meta = obj["metadata"]
    try:
        await kube.create(res, obj, meta["namespace"])
        return True
    except ApiError as e:
        if e.conflict:
            if refused is not None and readable:
                await _check_namesake(kube, res, obj, refused)
            return False
        if refused is None or (r := rejection(obj["kind"], meta["name"], e.status, e.message)) is None:
            raise
        refused.append(r)
        return False


async def _create_accounts(kube: KubeClient, objects: list[dict], refused: list[Rejection]) -> None:
    """A pod's ServiceAccount, Role and RoleBinding, before the pod (refused without its account). They
    belong to the namespace, not to one child: one that exists is kept as it is (the operator may create
    them, not read them)."""
    for obj in objects:
        await _create(kube, _RESOURCES[obj["kind"]], obj, refused, readable=False)


async def _check_namesake(kube: KubeClient, res: Resource, obj: dict, refused: list[Rejection]) -> None:
    meta = obj["metadata"]
    owner = (meta.get("ownerReferences") or [{}])[0]
    existing = await kube.get_or_none(res, meta["name"], meta["namespace"])
    if existing is not None and controller_uid(existing) != owner.get("uid"):
        refused.append(Rejection(obj["kind"], meta["name"], (
            f"a {obj['kind']} named {meta['name']} already exists and is not owned by {owner.get('kind')} "
            f"{owner.get('name')}; it is left alone: delete or rename it"), permanent=False, status=409))


async def _patch(kube: KubeClient, res: Resource, obj: dict, body: dict, refused: list[Rejection]) -> bool:
    meta = obj["metadata"]
    try:
        await kube.merge_patch(res, meta["name"], body, meta["namespace"])
        return True
    except ApiError as e:
        if (r := rejection(obj["kind"], meta["name"], e.status, e.message)) is None:
            raise
        refused.append(r)
        return False


def merge_patch_delta(current: dict, new: dict) -> dict:
    """The JSON merge patch that turns `current` into `new`, naming only what changed: a field another
    writer shares (the trainer's `status.trainer.ranks`) is left alone unless this writer changes it.
    None removes a key."""
    delta: dict = {}
    for key in set(current) | set(new):
        before, after = current.get(key), new.get(key)
        if before == after:
            continue
        delta[key] = merge_patch_delta(before, after) if isinstance(before, dict) and isinstance(after, dict) \
            else after
    return delta


async def write_status(kube: KubeClient, res: Resource, obj: dict, status: dict, current: dict,
                       owned: tuple[str, ...] | None = None) -> str | None:
    """One merge patch of /status when it differs from what the object shows; returns the object's
    resourceVersion after the write, None when nothing was written.

    Keys the writer owns (all when `owned` is None) that the new status leaves out are removed.
    """
    keys = set(status) | {k for k in current if owned is None or k in owned}
    if all(current.get(k) == status.get(k) for k in keys):
        return None
    patch = merge_patch_delta({k: current.get(k) for k in keys}, {k: status.get(k) for k in keys})
    written = await kube.merge_patch(res, obj["metadata"]["name"], {"status": patch}, obj["metadata"]["namespace"],
                                     sub="status")
    return (written or {}).get("metadata", {}).get("resourceVersion")


async def reconcile_fleet(kube: KubeClient, fleet: dict, pods: list[dict], *, router_deployment: dict | None,
                          router_service: bool, network_policy: dict | None, settings: Settings,
                          now: float | None = None, foreign: Sequence[tuple[str, dict]] = (),
                          reported: set[str] | None = None, router_network_policy: dict | None = None) -> FleetPlan:
    """One level-based reconcile of a RolloutFleet/EvalFleet from its engine pods and child objects.

    `pods`, `router_deployment`, `network_policy`, `router_network_policy`: the fleet's own children
    (owned by its UID) as observed (None: there is none). `foreign`: (kind, object) labelled as its
    children but not owned: reported once each (by UID, in `reported`), never touched. A child the API
    server refuses sets the ChildRejected condition within this pass (a second status write); a
    permanent refusal holds the fleet's creations until its spec changes.
    """
    meta = fleet["metadata"]
    name, ns = meta["name"], meta["namespace"]
    now = now or time.time()
    generation = meta.get("generation")
    spec = b.fleet_spec(fleet)  # validated once here; the deciders and builders below take it typed
    # A fleet of no run takes an edit of its engine spec by replacing its pods; a run's fleet follows its run.
    owner = b.owning_run(fleet, spec)
    digest = None if owner else b.engine_spec_digest(spec)
    plan = decide_fleet_actions(spec, pods, fleet.get("status"), fleet_name=name, now=now, generation=generation,
                                engine_spec=digest)
    plan.events.extend(unowned_run_name_events(spec, owner, fleet.get("status"), generation))
    res = custom(PLURALS[fleet["kind"]])
    # The orchestrator's marks are the trainer's part of the status: never written (nor removed) here.
    old = {k: v for k, v in (fleet.get("status") or {}).items() if k != ORCHESTRATOR}
    previous = old.get("conditions")
    first = rejections.carry(plan.status, previous, generation)
    first_version = await write_status(kube, res, fleet, first, old)
    for pod_name, uid in plan.delete:
        await kube.delete(PODS, pod_name, ns, uid=uid)
    refused: list[Rejection] = []
    if rejections.held(previous, generation) is None:
        await _write_fleet_children(kube, fleet, spec, plan, router_deployment, router_service, network_policy,
                                    router_network_policy, settings, refused)
    final = rejections.apply(plan.status, refused, previous, now=now, generation=generation)
    final_version = await write_status(kube, res, fleet, final, first)
    plan.status = final
    plan.superseded_versions = superseded(meta.get("resourceVersion"), [first_version, final_version])
    plan.events.extend(rejections.events(refused, previous))
    plan.events.extend(rejections.foreign_events(fleet["kind"], name, foreign, reported if reported is not None
                                                 else set()))
    if plan.recreated:
        metrics.OPERATOR_RECREATIONS.labels(namespace=ns, fleet=name).inc(len(plan.recreated))
    if plan.given_up:
        metrics.OPERATOR_SLOTS_FAILED.labels(namespace=ns, fleet=name).inc(len(plan.given_up))
    metrics.OPERATOR_READY_ENGINES.labels(namespace=ns, fleet=name).set(plan.status["readyReplicas"])
    await _post_events(kube, fleet, plan.events, settings)
    if any(not r.permanent for r in refused):
        raise ChildrenRefused(rejections.message([r for r in refused if not r.permanent]))
    return plan


async def _write_fleet_children(kube: KubeClient, fleet: dict, spec: FleetSpec, plan: FleetPlan,
                                router_deployment: dict | None, router_service: bool, network_policy: dict | None,
                                router_network_policy: dict | None, settings: Settings,
                                refused: list[Rejection]) -> None:
    """The fleet's API key Secret (a fleet of no run), engine pods, the router Deployment (for a fleet of no
    run, with its engine follower and, cluster-wide, its account) and Service, the engine and router
    NetworkPolicies; refusals to `refused`."""
    router = decide_router_deployment(fleet, router_deployment, spec, follower_image=settings.follower_image)
    if not b.owning_run(fleet, spec) and (plan.create or (router is not None and router.verb == "create")):
        # A fleet of no run holds its own key (a run's fleets get theirs from the run, before they exist).
        await _create(kube, SECRETS, b.build_api_key_secret(fleet, fleet["metadata"]["name"], new_api_key()),
                      refused, readable=False)
    for slot, restarts in plan.create:
        await _create(kube, PODS, b.build_engine_pod(fleet, slot, restarts=restarts,
                                                     rlfleet_image=settings.rlfleet_image, spec=spec), refused)
    if router is not None and settings.workload_rbac and b.follows_engine_pods(fleet, spec):
        await _create_accounts(kube, b.build_router_rbac(fleet["metadata"]["namespace"]), refused)
    if router is not None and router.verb == "create":
        await _create(kube, DEPLOYMENTS, router.obj, refused)
    elif router is not None and await _patch(kube, DEPLOYMENTS, router.obj, {"spec": router.obj["spec"]}, refused):
        plan.events.append(Event("Normal", reasons.ROUTER_UPDATED, f"router spec changed: rolling "
                                                                   f"{router.obj['metadata']['name']}"))
    if not router_service:
        await _create(kube, SERVICES, b.build_router_service(fleet, spec), refused)
    await _apply_network_policy(kube, fleet, spec, network_policy, plan, settings, refused)
    await _apply_router_network_policy(kube, fleet, spec, router_network_policy, plan, settings, refused)


async def _apply_network_policy(kube: KubeClient, fleet: dict, spec: FleetSpec, current: dict | None,
                                plan: FleetPlan, settings: Settings, refused: list[Rejection]) -> None:
    """The engines' NetworkPolicy: created, restored or deleted as decided."""
    await _apply_policy(kube, fleet, spec, current, plan, settings, refused, build=b.build_engine_network_policy,
                        admits=f"engines admit only {_admitted(fleet, spec, settings)}")


async def _apply_router_network_policy(kube: KubeClient, fleet: dict, spec: FleetSpec, current: dict | None,
                                       plan: FleetPlan, settings: Settings, refused: list[Rejection]) -> None:
    """The router's NetworkPolicy: only the run's trainer (or client pods) reach its HTTP port."""
    run = b.owning_run(fleet, spec)
    who = f"the trainer pod of run {run}" if run else f'pods labelled {b.LABEL_CLIENT}: "true"'
    await _apply_policy(kube, fleet, spec, current, plan, settings, refused, build=b.build_router_network_policy,
                        admits=f"the router admits only {who}")


async def _apply_policy(kube: KubeClient, fleet: dict, spec: FleetSpec, current: dict | None, plan: FleetPlan,
                        settings: Settings, refused: list[Rejection], *, build: Callable[..., dict],
                        admits: str) -> None:
    action = decide_network_policy(fleet, current, enabled=settings.network_policy,
                                   metrics_from=list(settings.network_policy_metrics_from), spec=spec, build=build)
    if action is None:
        return
    meta = action.obj["metadata"]
    ns, name = fleet["metadata"]["namespace"], meta["name"]
    if action.verb == "create":
        if await _create(kube, NETWORK_POLICIES, action.obj, refused):
            plan.events.append(Event("Normal", reasons.NETWORK_POLICY_CREATED, f"NetworkPolicy {name}: {admits}"))
    elif action.verb == "patch":
        if not await _patch(kube, NETWORK_POLICIES, action.obj, {"spec": action.obj["spec"]}, refused):
            return
        plan.events.append(Event("Warning", reasons.NETWORK_POLICY_RESTORED,
                                 f"NetworkPolicy {name} had been changed; restored: {admits}"))
    elif await kube.delete(NETWORK_POLICIES, name, ns, uid=meta.get("uid")) is not None:
        plan.events.append(Event("Normal", reasons.NETWORK_POLICY_DELETED,
                                 f"NetworkPolicy {name} deleted: the operator's network policy is switched off"))


def _admitted(fleet: dict, spec: FleetSpec, settings: Settings) -> str:
    run_name = b.owning_run(fleet, spec)
    who = [f"router pods of {fleet['metadata']['name']}",
           f"the trainer pod of run {run_name}" if run_name else f'pods labelled {b.LABEL_CLIENT}: "true"']
    if settings.network_policy_metrics_from:
        who.append(f"{len(settings.network_policy_metrics_from)} metrics peer(s) on the HTTP port")
    return ", ".join(who)


_RESOURCES: dict[str, Resource] = {
    "PersistentVolumeClaim": PVCS,
    "Pod": PODS,
    "ServiceAccount": SERVICEACCOUNTS,
    "Role": ROLES,
    "RoleBinding": ROLE_BINDINGS,
    "RolloutFleet": custom(PLURALS["RolloutFleet"]),
    "EvalFleet": custom(PLURALS["EvalFleet"]),
}


async def reconcile_run(kube: KubeClient, run: dict, children: RunChildren, *, settings: Settings,
                        now: float | None = None, foreign: Sequence[tuple[str, dict]] = (),
                        reported: set[str] | None = None) -> RunPlan:
    """One level-based reconcile of a TrainingRun from its children (owned by its UID).

    A child the API server refuses for good fails the run (reason ChildRejected, the server's message)
    within this pass; one refused for a reason that clears by itself sets Degraded and is retried.
    `foreign` objects (labelled for the run, not owned by it) are reported once each, never touched.
    """
    meta = run["metadata"]
    now = now or time.time()
    generation = meta.get("generation")
    plan = decide_run(run, children, now=now, rlfleet_image=settings.rlfleet_image)
    old = owned_status(run.get("status"))
    previous = old.get("conditions")
    first = rejections.carry(plan.status, previous, generation)
    first_version = await write_status(kube, TRAININGRUNS, run, first, old, owned=OPERATOR_STATUS_KEYS)
    for pod_name, uid in plan.delete:  # a failed trainer group's pods, after its failure is in the status
        await kube.delete(PODS, pod_name, meta["namespace"], uid=uid)
    refused: list[Rejection] = []
    await _create_api_keys(kube, run, plan.api_key_fleets, refused)
    if settings.workload_rbac and any(obj["kind"] == "Pod" for obj in plan.create):
        await _create_accounts(kube, b.build_trainer_rbac(meta["namespace"]), refused)
    # Broadcast: the update group's policies converge before rank 0's pod is created.
    await _apply_update_group_policies(kube, run, children.update_group_policies, plan, settings, refused)
    for obj in plan.create:
        await _create(kube, _RESOURCES[obj["kind"]], obj, refused)
    for kind, name, spec in plan.patch_fleet_specs:
        await _patch(kube, _RESOURCES[kind], {"kind": kind, "metadata": {"name": name, "namespace": meta["namespace"]}},
                     {"spec": spec}, refused)
    permanent = [r for r in refused if r.permanent]
    if permanent:  # the run fails: decided again with the refusal, its Event included
        plan = decide_run(run, children, now=now, rlfleet_image=settings.rlfleet_image, rejected=permanent)
    final = rejections.apply(plan.status, [r for r in refused if not r.permanent], previous, now=now,
                             generation=generation)
    final_version = await write_status(kube, TRAININGRUNS, run, final, first, owned=OPERATOR_STATUS_KEYS)
    plan.status = final
    plan.superseded_versions = superseded(meta.get("resourceVersion"), [first_version, final_version])
    plan.events.extend(rejections.events([r for r in refused if not r.permanent], previous))
    plan.events.extend(rejections.foreign_events(run["kind"], meta["name"], foreign,
                                                 reported if reported is not None else set()))
    await _post_events(kube, run, plan.events, settings)
    if any(not r.permanent for r in refused):
        raise ChildrenRefused(rejections.message([r for r in refused if not r.permanent]))
    return plan


async def _apply_update_group_policies(kube: KubeClient, run: dict, current: Sequence[dict], plan: RunPlan,
                                       settings: Settings, refused: list[Rejection]) -> None:
    """The run's update-group NetworkPolicies: created, restored or deleted as decided."""
    for action in decide_update_group_policies(run, current, enabled=settings.network_policy):
        meta = action.obj["metadata"]
        if action.verb == "create":
            if await _create(kube, NETWORK_POLICIES, action.obj, refused):
                plan.events.append(Event("Normal", reasons.NETWORK_POLICY_CREATED, action.why))
        elif action.verb == "patch":
            body = {"spec": merge_patch_delta((action.current or {}).get("spec") or {}, action.obj["spec"])}
            if await _patch(kube, NETWORK_POLICIES, action.obj, body, refused):
                plan.events.append(Event("Warning", reasons.NETWORK_POLICY_RESTORED, action.why))
        elif await kube.delete(NETWORK_POLICIES, meta["name"], meta["namespace"], uid=meta.get("uid")) is not None:
            plan.events.append(Event("Normal", reasons.NETWORK_POLICY_DELETED, action.why))


async def _create_api_keys(kube: KubeClient, run: dict, fleets: list[str], refused: list[Rejection]) -> None:
    """Before the run's fleets or its trainer are created: the fleets' Secrets `<fleet>-api-key`, owned
    by the run, one key for both fleets (the trainer holds one). An existing Secret is kept as it is."""
    if not fleets:
        return
    key = new_api_key()
    for fleet_name in fleets:
        await _create(kube, SECRETS, b.build_api_key_secret(run, fleet_name, key), refused, readable=False)


def compact_pod(body: Any) -> dict:
    """The parts of a pod the decisions read (the index keeps thousands of them in memory)."""
    meta = body.get("metadata", {})
    status = body.get("status") or {}
    keep_meta = {k: meta.get(k) for k in ("name", "namespace", "uid", "labels", "annotations", "creationTimestamp",
                                          "deletionTimestamp", "ownerReferences") if meta.get(k) is not None}
    keep_status = {k: status.get(k) for k in ("phase", "podIP", "startTime", "message", "reason", "conditions",
                                              "containerStatuses", "initContainerStatuses")
                   if status.get(k) is not None}
    return _plain({"metadata": keep_meta, "status": keep_status})


def _plain(value: Any) -> Any:
    """Deep copy into plain dicts and lists (Kopf bodies are live views)."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


plain = _plain
