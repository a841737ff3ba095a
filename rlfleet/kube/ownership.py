"""Which objects are a parent's own children: matched by the controller ownerReference's UID. Pure.

Labels say what an object claims to be; anyone who may create pods in a namespace can put the
operator's labels on one. Only the controller ownerReference, carrying the parent's UID (unique for
the life of the cluster, never reused by a recreated namesake), says who made it. A labelled object
its parent does not own is foreign: it is ignored (never adopted, never deleted) and reported.
"""
from __future__ import annotations

from collections.abc import Iterable


def controller_uid(obj: dict) -> str | None:
    """The UID of the object's controller (the ownerReference with `controller: true`), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def owned_by(obj: dict, owner_uid: str | None) -> bool:
    return bool(owner_uid) and controller_uid(obj) == owner_uid


def partition(objs: Iterable[dict], owner_uid: str | None) -> tuple[list[dict], list[dict]]:
    """(owned, foreign): the objects the owner controls, and the others (labelled alike, not its own)."""
    owned: list[dict] = []
    foreign: list[dict] = []
    for obj in objs:
        (owned if owned_by(obj, owner_uid) else foreign).append(obj)
    return owned, foreign


def owned_router_pods(pods: Iterable[dict], replica_sets: Iterable[dict], deployment: dict | None,
                      fleet_uid: str | None) -> list[dict]:
    """The pods of the fleet's router: owned by a ReplicaSet owned by the router Deployment, which the
    fleet owns. Any other pod with router labels is foreign, whatever it claims."""
    if deployment is None or not owned_by(deployment, fleet_uid):
        return []
    deployment_uid = deployment["metadata"].get("uid")
    sets = {rs["metadata"].get("uid") for rs in replica_sets if owned_by(rs, deployment_uid)}
    return [p for p in pods if controller_uid(p) in sets]

