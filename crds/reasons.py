"""Reasons of the conditions, Events and slot failures the operator writes: CamelCase, part of the API.

Users and alerts match on them (`kubectl get events --field-selector reason=EngineCrashLoop`), so
they are named once here.
"""
from __future__ import annotations

AS_EXPECTED = "AsExpected"  # a condition that is False for no particular reason

# Why an engine slot failed (`status.engines[].lastFailure.reason`); a dead mark gives its own.
CRASHED = "Crashed"  # a container exited non-zero
EXITED = "Exited"  # a container exited 0 (an engine never should)
POD_FAILED = "PodFailed"  # the pod failed without a terminated container (e.g. evicted)
MARKED_DEAD = "MarkedDead"  # the orchestrator's dead mark, when it names no reason
STARTUP_TIMEOUT = "StartupTimeout"
POD_DELETED = "PodDeleted"

# Fleet Events.
CREATING_ENGINES = "CreatingEngines"
SCALED_DOWN = "ScaledDown"
ENGINE_DEAD = "EngineDead"
RECREATING_ENGINE = "RecreatingEngine"
UPDATING_ENGINE = "UpdatingEngine"
RESTART_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
ROUTER_UPDATED = "RouterUpdated"
NETWORK_POLICY_CREATED = "NetworkPolicyCreated"
NETWORK_POLICY_RESTORED = "NetworkPolicyRestored"
NETWORK_POLICY_DELETED = "NetworkPolicyDeleted"

# Fleet conditions.
ENGINES_READY = "EnginesReady"
ENGINES_NOT_READY = "EnginesNotReady"
ENGINES_STARTING = "EnginesStarting"
ENGINES_UPDATING = "EnginesUpdating"
STABLE = "Stable"
ENGINES_DOWN = "EnginesDown"
ENGINE_CRASH_LOOP = "EngineCrashLoop"  # Failed: the slot that gave up crashed or exited
ENGINE_FAILED = "EngineFailed"  # Failed: it gave up for another reason (probes, startup, ...)

# TrainingRun conditions and Events (the phase names are Events too: Running, Succeeded).
RESTORING_FLEET_SPEC = "RestoringFleetSpec"  # a run's fleet was edited apart from its run: set back
SCALING_FLEET = "ScalingFleet"  # a run scales its fleet to its spec (its replicas changed, or a scale was undone)
TRAINING = "Training"
STARTING = "Starting"
FINISHED = "Finished"
NOT_READY = "NotReady"
TRAINER_FAILED = "TrainerFailed"
TRAINER_LOST = "TrainerLost"
TRAINER_DEAD = "TrainerDead"  # Event: the trainer pod failed or vanished; recreated after its backoff
RECREATING_TRAINER = "RecreatingTrainer"  # Event: a trainer pod created again (restart n of maxRestarts)
INVALID_SPEC = "InvalidSpec"

# Children (conditions of the owner, Events).
CHILD_REJECTED = "ChildRejected"  # the API server refused a child the operator built (server's message quoted)
RUN_NAME_NOT_OWNED = "RunNameNotOwned"  # Event: a fleet names a run that does not own it (a fleet of no run)
FOREIGN_CHILD_IGNORED = "ForeignChildIgnored"  # an object labelled as a child but not owned: ignored
