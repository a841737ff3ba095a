"""What one reconcile of a TrainingRun does to its update group's NetworkPolicies. Pure: no I/O.

A broadcast run or a trainer group owns `<run>-trainer` (and, broadcasting, `<run>-update-group`):
`builders.build_trainer_network_policies`. They converge like a fleet's own policies: each one wanted
exists with exactly the builder's spec (a manual edit or deletion is undone), and any other of the run's
is deleted once it is no longer wanted (the operator's `networkPolicy` switched off, or the run neither
broadcasting nor a trainer group).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from rlfleet.operator import builders as b


@dataclass(frozen=True)
class PolicyAction:
    """One write to a run's update-group NetworkPolicy: create `obj`, patch its spec to `obj`'s, or
    delete it (`obj` is then the observed one); `why` is the Event's message; `current`: the observed
    policy a patch replaces (what it names beyond the builder's spec is removed)."""

    verb: str  # create | patch | delete
    obj: dict
    why: str
    current: dict | None = None


def decide_update_group_policies(run: dict, current: Sequence[dict], *, enabled: bool) -> list[PolicyAction]:
    """The writes that make the run's update-group NetworkPolicies what the run wants.

    `current`: the run's own policies of that component as observed (identity and spec). `enabled`:
    the operator writes NetworkPolicies at all. A run whose spec does not validate keeps what it has
    (it fails on its status; nothing here opens or closes the group meanwhile) unless the operator's
    policies are switched off: then every one goes, whatever the spec. Creations and
    patches come first, so a policy is in place before anything that depends on it is written.
    """
    if enabled:
        try:
            spec = b.run_spec(run)
            wanted = b.build_trainer_network_policies(run, spec)
        except (ValidationError, ValueError):
            return []
        gone = (f"the run does not want it (weightSync.mode: {spec.weight_sync.mode}, "
                f"trainer.nodes: {spec.trainer.nodes})")
    else:
        wanted, gone = [], "the operator's network policy is switched off"
    observed = {p["metadata"]["name"]: p for p in current}
    actions: list[PolicyAction] = []
    for desired in wanted:
        name = desired["metadata"]["name"]
        have = observed.pop(name, None)
        if have is None:
            actions.append(PolicyAction("create", desired, f"NetworkPolicy {name}: {_admits(name, run)}"))
        elif have["metadata"].get("deletionTimestamp"):
            continue  # created again once it is gone
        elif have.get("spec") != desired["spec"]:
            actions.append(PolicyAction("patch", desired,
                                        f"NetworkPolicy {name} had been changed; restored: {_admits(name, run)}",
                                        current=have))
    for name in sorted(observed):
        have = observed[name]
        if not have["metadata"].get("deletionTimestamp"):
            actions.append(PolicyAction("delete", have, f"NetworkPolicy {name} deleted: {gone}"))
    return actions


def _admits(name: str, run: dict) -> str:
    run_name = run["metadata"]["name"]
    fleet = b.rollout_fleet_name(run_name)
    if name == b.trainer_network_policy_name(run_name):
        return f"the trainer of run {run_name} admits only the engines of {fleet} and its own pods on its ports"
    return f"the engines of {fleet} admit each other on the update group's ports"
