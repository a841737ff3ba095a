"""What a TrainingRun may ask for that runs locally (`rlfleet run FILE`) but not yet on Kubernetes.

One source for both sides: the operator fails such a run before it creates anything (reason
InvalidSpec), and the trainer pod refuses it again at start. Pure.
"""
from __future__ import annotations

from rlfleet.crds.models import TrainingRunSpec


def unsupported_on_kubernetes(spec: TrainingRunSpec) -> list[str]:
    """`field: why` for each part of the spec a trainer pod cannot run yet (empty: it can run all of it)."""
    problems = []
    if spec.weight_sync.mode == "broadcast":
        # Engine pods would have to reach the trainer pod's update-group port (NetworkPolicy, pod address).
        problems.append("spec.weightSync.mode: broadcast runs with `rlfleet run` (local processes) only so far; "
                        "on Kubernetes use mode disk")
    # A trainer of several ranks on one node is one pod that starts its ranks itself (spec.trainer.nodes
    # is 1 by the API's own rule).
    return problems
