"""What a TrainingRun may ask for that runs locally (`rlfleet run FILE`) but not yet on Kubernetes.

One source for both sides: the operator fails such a run before it creates anything (reason
InvalidSpec), and the trainer pod refuses it again at start. Pure.
"""
from __future__ import annotations

from rlfleet.crds.models import TrainingRunSpec


def unsupported_on_kubernetes(spec: TrainingRunSpec) -> list[str]:
    """`field: why` for each part of the spec a trainer pod cannot run yet (empty: it can run all of it)."""
    problems = []
    if spec.trainer.world_size > 1:
        problems.append(f"spec.trainer: a trainer of {spec.trainer.world_size} ranks (tensor x pipeline x data "
                        "parallel) runs with `rlfleet run` only so far; a trainer pod runs one rank")
    return problems
