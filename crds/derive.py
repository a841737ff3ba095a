"""Pure functions from a TrainingRun spec to what it implies: engine specs, fleet specs, the tiny model.

The only derivation of a run's fleets: the operator's builders wrap `rollout_fleet_spec` and
`eval_fleet_spec` in object metadata, and the local runner starts its engines from `rollout_engine`
and its eval fleet from `eval_fleet_spec`, so the two modes agree.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from rlfleet.crds.eval_specs import effective_eval_engine
from rlfleet.crds.fleet_specs import EvalFleetSpec, RolloutFleetSpec, SnapshotMountSpec
from rlfleet.crds.models import TINY_MODEL_PATTERN, TrainingRunSpec
from rlfleet.crds.specs import EngineSpec

TINY_SCHEME = "tiny://"


@dataclass(frozen=True)
class TinyModelRef:
    """`tiny://llama?seed=0`: the project's tiny offline model, generated where it is needed."""

    arch: str
    seed: int

    @property
    def cache_name(self) -> str:
        return f"tiny-{self.arch}-seed{self.seed}"


def match_tiny_model(model_path: str) -> TinyModelRef | None:
    """The tiny model a path names; None for anything else, a malformed tiny:// path included."""
    if not re.match(TINY_MODEL_PATTERN, model_path):
        return None
    parts = urlsplit(model_path)
    seed = int(parse_qs(parts.query).get("seed", ["0"])[0])
    return TinyModelRef(arch=parts.netloc, seed=seed)


def parse_tiny_model(model_path: str) -> TinyModelRef | None:
    """The tiny model a path names, or None for an ordinary directory or hub id; a malformed
    tiny:// path raises ValueError."""
    tiny = match_tiny_model(model_path)
    if tiny is None and model_path.startswith(TINY_SCHEME):
        raise ValueError(f"{model_path!r}: a tiny model path reads tiny://llama, tiny://qwen2 or tiny://qwen3, "
                         "optionally ?seed=N")
    return tiny


def rollout_engine(spec: TrainingRunSpec) -> EngineSpec:
    """The rollout engine spec with the model path resolved (the run's modelPath unless overridden)."""
    template = spec.rollout.engine
    data = template.model_dump()
    data["model_path"] = template.model_path or spec.model_path
    return EngineSpec.model_validate(data)


def eval_engine(spec: TrainingRunSpec) -> EngineSpec | None:
    """The eval fleet's effective engine spec (posture fleet only)."""
    if spec.eval is None or spec.eval.fleet is None:
        return None
    return effective_eval_engine(rollout_engine(spec), spec.eval.fleet.engine)


def snapshot_claim_name(run_name: str, spec: TrainingRunSpec) -> str:
    """The run's snapshot claim: the named one, or the one the operator creates."""
    return spec.weight_sync.snapshot_volume.claim_name or f"{run_name}-snapshots"


def _snapshots(run_name: str, spec: TrainingRunSpec) -> SnapshotMountSpec:
    return SnapshotMountSpec(claim_name=snapshot_claim_name(run_name, spec), mount_path=spec.weight_sync.mount_path)


def rollout_fleet_spec(run_name: str, spec: TrainingRunSpec) -> RolloutFleetSpec:
    """The RolloutFleet a TrainingRun owns."""
    rollout = spec.rollout
    return RolloutFleetSpec(
        replicas=rollout.replicas,
        min_ready_engines=rollout.min_ready_engines,
        engine=rollout_engine(spec),
        health=rollout.health,
        recovery=rollout.recovery,
        router=rollout.router,
        run_name=run_name,
        snapshots=_snapshots(run_name, spec),
    )


def eval_fleet_spec(run_name: str, spec: TrainingRunSpec) -> EvalFleetSpec | None:
    """The EvalFleet a TrainingRun owns (posture fleet), with unset settings taken from the rollout fleet."""
    engine = eval_engine(spec)
    if engine is None:
        return None
    assert spec.eval is not None and spec.eval.fleet is not None, "eval_engine is set only for posture fleet"
    fleet = spec.eval.fleet
    return EvalFleetSpec(
        replicas=fleet.replicas,
        min_ready_engines=fleet.min_ready_engines,
        engine=engine,
        health=fleet.health or spec.rollout.health,
        recovery=fleet.recovery or spec.rollout.recovery,
        router=fleet.router or spec.rollout.router,
        run_name=run_name,
        snapshots=_snapshots(run_name, spec),
    )
