"""The `rlfleet` command. Each subcommand lives in its own module with `add_arguments` and `run`."""
from __future__ import annotations

import argparse
import importlib
import sys

import rlfleet

# name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS = {
    "run": ("rlfleet.orchestrator.run.cli", "run a TrainingRun YAML on this machine (local processes)"),
    "validate": ("rlfleet.crds.validate_cli", "check TrainingRun/RolloutFleet/EvalFleet YAML files"),
    "watchdog": ("rlfleet.orchestrator.guards.watchdog_cli", "replay recorded rollout errors through the 503 watchdog"),
    "dev-cluster": ("rlfleet.devcluster.cli", "start/stop a local Kubernetes control plane (no Docker)"),
    "operator": ("rlfleet.operator.main", "run the Kubernetes operator"),
    "follow-engines": ("rlfleet.orchestrator.fleet.follow_cli",
                       "keep a fleet of no run's router routing to its Ready engine pods (its router pod runs it)"),
    "tiny-model": ("rlfleet.trainer.tiny", "write the tiny offline test model"),
    "check-monitoring": ("rlfleet.observability.cli", "check dashboards and alert rules against the exported metrics"),
    "report": ("rlfleet.observability.report.cli", "write a run's report (HTML with plots, PNG) from its summary"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rlfleet", description=rlfleet.__doc__)
    parser.add_argument("--version", action="version", version=f"rlfleet {rlfleet.__version__}")
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv or ["--help"])
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.parse_args([command])  # prints the choices and exits 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
