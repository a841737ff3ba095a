"""A W&B run's .wandb transaction log read back with W&B's own reader (`wandb leet inspect --json`, which
prints every record of the log as one JSON object a line)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_KEYS = {"step": "train", "eval/step": "eval"}


@dataclass
class WandbLog:
    run: dict[str, Any]  # the run record: display_name, project, config, ...
    config: dict[str, Any]
    rows: list[dict[str, Any]]  # the history rows, in order
    exit_code: int | None  # from the exit record; None when the run did not finish
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # tag -> [(step, value)]


def offline_log(directory: Path) -> Path:
    """The one offline run's .wandb file under `directory` (W&B's `wandb/offline-run-*/run-*.wandb`)."""
    found = sorted(directory.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(found) == 1, f"expected one offline W&B run under {directory}, found {found}"
    return found[0]


def read_log(path: Path) -> WandbLog:
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    run = next(r["run"] for r in records if r["type"] == "run")
    config: dict[str, Any] = {}
    for r in records:
        if r["type"] == "run":
            config.update(r["run"].get("config", {}).get("update", {}))
        elif r["type"] == "config":
            config.update(r["config"].get("update", {}))
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    exits = [r["exit"] for r in records if r["type"] == "exit"]
    log = WandbLog(run=run, config=config, rows=rows, exit_code=exits[-1].get("exit_code", 0) if exits else None)
    for row in rows:
        step_key = next(k for k in STEP_KEYS if k in row)
        for tag, value in row.items():
            if tag.startswith("_") or tag in STEP_KEYS:
                continue
            log.series.setdefault(tag, []).append((int(row[step_key]), float(value)))
    return log
