"""A trainer pod's place in its trainer group (spec.trainer.nodes > 1): node rank and pod 0's address.

The operator creates the group's pods `<run>-trainer-<i>` together, each with its node rank in
$RLFLEET_TRAINER_NODE. Every pod's rank launcher meets pod 0's on pod 0's IP and the rendezvous port;
the cluster may have no DNS, so that IP is read from pod 0's status through the API server (the
trainer's Role may read pods). Pod 0 uses its own $POD_IP. A pod of another incarnation (the
`rlfleet.io/restarts` annotation: a group being replaced) is not the group's pod 0: it is waited out.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from rlfleet.crds.conventions import ANN_RESTARTS, TRAINER_RENDEZVOUS_PORT, trainer_pod_name
from rlfleet.crds.managed import ReservedEnv
from rlfleet.kube.client import PODS, ApiError, KubeClient

POLL_S = 1.0
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GroupPlace:
    """Where this pod's launcher stands in the group."""

    node_rank: int
    nodes: int
    rendezvous: tuple[str, int]  # pod 0's address and the rendezvous port


def node_rank_from_env(nodes: int, env: dict[str, str] | os._Environ = os.environ) -> int:
    """$RLFLEET_TRAINER_NODE as a node rank of a group of `nodes`; ValueError naming it when wrong."""
    raw = env.get(ReservedEnv.TRAINER_NODE)
    try:
        rank = int(raw) if raw is not None else -1
    except ValueError:
        rank = -1
    if not 0 <= rank < nodes:
        raise ValueError(f"${ReservedEnv.TRAINER_NODE} is {raw!r}: a pod of a trainer group of spec.trainer.nodes "
                         f"{nodes} needs its node rank 0..{nodes - 1} (the operator sets it)")
    return rank


def leader_address(pod0: dict | None, incarnation: str | None) -> str | None:
    """Pod 0's IP when `pod0` is this group's pod 0 (same incarnation, not being deleted) and has one."""
    if pod0 is None:
        return None
    meta = pod0.get("metadata") or {}
    if meta.get("deletionTimestamp") or (meta.get("annotations") or {}).get(ANN_RESTARTS) != incarnation:
        return None
    return (pod0.get("status") or {}).get("podIP") or None


async def find_place(kube: KubeClient, namespace: str, run_name: str, nodes: int, *, timeout_s: float,
                     env: dict[str, str] | os._Environ = os.environ) -> GroupPlace:
    """This pod's node rank and the group's rendezvous address (pod 0's IP: its own, or read from the
    API server until pod 0 of this incarnation has one, within `timeout_s`)."""
    rank = node_rank_from_env(nodes, env)
    if rank == 0:
        own = env.get(ReservedEnv.POD_IP)
        if not own:
            raise ValueError(f"pod 0 of a trainer group needs its address in ${ReservedEnv.POD_IP} (status.podIP)")
        return GroupPlace(0, nodes, (own, TRAINER_RENDEZVOUS_PORT))
    own_name = env.get(ReservedEnv.POD_NAME) or trainer_pod_name(run_name, rank)
    leader = trainer_pod_name(run_name, 0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    me: dict | None = None
    seen: dict | None = None
    state = "absent"
    while loop.time() < deadline:
        # A passing API-server error (no answer, 429, 5xx) is read again at the next poll, within the bound.
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                if me is None:
                    me = await kube.get(PODS, own_name, namespace)
                seen = await kube.get(PODS, leader, namespace)
        except ApiError as exc:
            if exc.not_found and me is not None:
                seen, state = None, "absent"
            elif exc.passing:
                seen, state = None, f"the API server answered {exc}"
            else:
                raise
        except TimeoutError:
            seen, state = None, "no answer from the API server"
        incarnation = (me["metadata"].get("annotations") or {}).get(ANN_RESTARTS) if me is not None else None
        address = leader_address(seen, incarnation) if me is not None else None
        if address:
            return GroupPlace(rank, nodes, (address, TRAINER_RENDEZVOUS_PORT))
        if seen is not None:
            state = (f"phase {(seen.get('status') or {}).get('phase')}, incarnation "
                     f"{(seen['metadata'].get('annotations') or {}).get(ANN_RESTARTS)}")
        await asyncio.sleep(POLL_S)
    if me is None:
        raise TimeoutError(f"could not read this pod ({own_name}) within {timeout_s:g} s: {state}")
    incarnation = (me["metadata"].get("annotations") or {}).get(ANN_RESTARTS)
    raise TimeoutError(f"pod {leader} (incarnation {incarnation}) had no address within {timeout_s:g} s: {state}")
