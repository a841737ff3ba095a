"""One `rlfleet run` in a real terminal (tmux) with TensorBoard, a real MLflow server and W&B (offline) as
trackers: the terminal view (bar, ETA, engine start-up states, no library noise), the TensorBoard event
files read back with TensorBoard's own reader, the offline W&B run's .wandb log read back with W&B's own
reader, the MLflow run read back with MLflow's own client, and the MLflow server stopped mid-run: the
run completes, warned once, its drops counted in a metric."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from helpers.cli_run import cli_run_pid, held, write_manifest
from helpers.mlflow_server import MlflowReader, MlflowServer
from helpers.wandb_log import offline_log, read_log

STEPS = 12
TRAIN_FIELDS = ("reward_mean", "reward_std", "loss", "clip_fraction", "grad_norm", "response_length_mean", "tokens",
                "samples", "stale_groups_dropped", "samples_per_s", "tokens_per_s", "seconds")
EVENT_KINDS = ("engine_dead", "engine_recreated", "heat_pause", "heat_resume", "watchdog_strike", "router_event",
               "fleet_resized")


def expected_series(summary: dict) -> tuple[dict, dict]:
    """tag -> [(step, value)] as the summary records them: training steps, and eval points apart."""
    train: dict[str, list] = {}
    for rec in summary["records"]:
        values = {f"train/{k}": rec[k] for k in TRAIN_FIELDS if rec[k] is not None}
        values.update({f"time/{k}": v for k, v in rec["phases"].items()})
        values.update({f"staleness/{k}": v for k, v in rec["staleness"].items()})
        values.update({f"events/{k}": sum(1 for e in summary["events"] if e["kind"] == k and e["step"] <= rec["step"])
                       for k in EVENT_KINDS})
        for tag, value in values.items():
            train.setdefault(tag, []).append((rec["step"], float(value)))
    evals: dict[str, list] = {}
    for point in summary["eval"]:
        if not point["skipped"]:
            for name, score in point["scores"].items():
                evals.setdefault(f"eval/{name}", []).append((point["step"], float(score)))
            evals.setdefault("eval/seconds", []).append((point["step"], float(point["seconds"])))
    return train, evals


def read_tensorboard(directory: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def same(series: dict, expected: dict, rel: float = 1e-5) -> None:
    assert sorted(series) == sorted(expected)
    for tag, points in expected.items():
        assert [s for s, _ in series[tag]] == [s for s, _ in points], tag
        assert [v for _, v in series[tag]] == pytest.approx([v for _, v in points], rel=rel, abs=1e-6), tag


class Tmux:
    """A private tmux server; one window 200 columns wide running `command`."""

    def __init__(self, name: str):
        self.socket = f"rlfleet-test-{os.getpid()}-{name}"

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], check=True,
                              capture_output=True, text=True, timeout=30).stdout

    def capture(self) -> str:
        return self("capture-pane", "-p", "-J", "-S", "-", "-t", "run")


def dropped_now(metrics_url: str) -> float | None:
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:  # the run has ended
        return None
    found = re.search(r'rlfleet_tracker_records_total\{outcome="dropped",tracker="mlflow"\} (\S+)', text)
    return float(found.group(1)) if found else None


def logged_steps(tracking_uri: str, experiment: str, key: str) -> list[int]:
    """The steps of one metric of the experiment's only run, over MLflow's REST API ([] before there is one)."""
    api = tracking_uri + "/api/2.0/mlflow"

    def call(path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(api + path, data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read() or b"{}")

    try:
        found = call(f"/experiments/get-by-name?experiment_name={urllib.parse.quote(experiment)}")
        runs = call("/runs/search", {"experiment_ids": [found["experiment"]["experiment_id"]]}).get("runs", [])
        if len(runs) != 1:
            return []
        run_id = runs[0]["info"]["run_id"]
        history = call(f"/metrics/get-history?run_id={run_id}&metric_key={urllib.parse.quote(key)}")
    except OSError:  # no experiment yet (HTTP 404), or no answer in time on a busy machine: asked again
        return []
    return [int(m.get("step", 0)) for m in history.get("metrics", [])]


def test_terminal_view_and_trackers_with_the_mlflow_server_stopped_mid_run(tmp_path: Path):
    reader = MlflowReader()
    server = MlflowServer(tmp_path / "mlflow").start()
    reader.wait_ready()
    assert "error" in reader.read(server.url, "tracked")  # nothing yet; the server's store is warm now
    manifest = write_manifest(tmp_path / "run.yaml", steps=STEPS, replicas=1, spec={
        "trainer": {"promptsPerStep": 4, "samplesPerPrompt": 4},
        "eval": {"posture": "shared", "intervalSteps": 4, "evalBeforeTrain": True,
                 "datasets": [{"name": "rotate", "task": "rotate", "maxPrompts": 8, "maxNewTokens": 3}]},
        "tracking": {"tensorboard": {}, "mlflow": {"trackingUri": server.url, "experiment": "tracked",
                                                   "timeoutSeconds": 30},
                     "wandb": {"project": "tracked", "mode": "offline"}},
    })
    run_dir, summary_path, exit_file = tmp_path / "run", tmp_path / "summary.json", tmp_path / "exit"
    command = (f"cd {shlex.quote(os.getcwd())} && env -u COLUMNS -u LINES {shlex.quote(sys.executable)} "
               "-P -m rlfleet.cli run "
               f"{manifest} --run-dir {run_dir} --metrics-port 0 --summary {summary_path}; echo $? > {exit_file}; "
               "sleep 600")
    tmux = Tmux("track")
    tmux("new-session", "-d", "-s", "run", "-x", "200", "-y", "50", command)
    seen: set[str] = set()
    stopped_after: int | None = None  # the last step line before the server was stopped
    read_back: dict | None = None
    dropped_metric = 0.0  # the run's own metric, scraped while it runs
    url = ""
    try:
        deadline = time.monotonic() + 900
        while not exit_file.exists():
            assert time.monotonic() < deadline, tmux.capture()[-4000:]
            screen = tmux.capture()
            seen.update(line.rstrip() for line in screen.splitlines())
            if stopped_after is None and re.search(rf"step 1/{STEPS} reward", screen):
                # One light REST read (MLflow's client reads every series: seconds on a busy machine, in which
                # the run could finish): once step 1's record is on the server, the server goes away mid-run.
                if 1 not in logged_steps(server.url, "tracked", "train/reward_mean"):
                    time.sleep(0.1)
                    continue
                # The run held while the server goes (a graceful stop takes seconds; 12 steps take about as
                # long): it finds the server gone with steps still to log.
                with held(cli_run_pid(run_dir)):
                    server.stop()
                    stopped_after = max(int(n) for n in re.findall(rf"step (\d+)/{STEPS} reward", tmux.capture()))
                url = re.search(r"metrics at (http://[^,\s]+)", screen).group(1)  # type: ignore[union-attr]
            if stopped_after is not None:
                dropped_metric = max(dropped_metric, dropped_now(url) or 0.0)
            time.sleep(0.5)
        final = tmux.capture()
        seen.update(line.rstrip() for line in final.splitlines())
        if stopped_after is not None:
            # What reached the server before it stopped, read back with MLflow's own client from the same
            # store, served again.
            server = MlflowServer(tmp_path / "mlflow")  # stopped below, even if it never comes up
            read_back = reader.read(server.start().url, "tracked")
    finally:
        subprocess.run(["tmux", "-L", tmux.socket, "kill-server"], capture_output=True)
        server.stop()
        reader.close()
    assert exit_file.read_text().strip() == "0", final[-4000:]
    text = "\n".join(sorted(seen))

    # The terminal view: engine start-up states, then a bar with elapsed and ETA; no library noise.
    assert re.search(r"engines 0/1 0:(starting|loading)", text), text[-4000:]
    assert re.search(r"engines 1/1 0:pinned v\d", text), text[-4000:]
    assert re.search(r"step \d+/12 \[#+-+\] +\d+% \| elapsed \d\d:\d\d ETA \d\d:\d\d \| \w", text), text[-4000:]
    assert "Loading weights" not in text and "UserWarning" not in text and "it/s]" not in text
    assert re.search(r"step 12/12 reward .* \(rollout \d+\.\d\d s, train \d+\.\d\d s, .*sync \d+\.\d\d s", text)
    assert final.count("tracker mlflow failed") == 1, final[-4000:]
    assert "tracker wandb failed" not in final and "tracker tensorboard failed" not in final, final[-4000:]

    summary = json.loads(summary_path.read_text())
    assert summary["steps_completed"] == STEPS and summary["failure"] is None
    train, evals = expected_series(summary)
    assert [p["step"] for p in summary["eval"] if not p["skipped"]] == [0, 4, 8, 12]

    # TensorBoard: every series and its steps as the summary records them.
    tb = run_dir / "tensorboard" / run_dir.name
    same(read_tensorboard(tb), train)
    same(read_tensorboard(tb / "eval"), evals)
    assert summary["tracking"]["tensorboard"] == {"written": STEPS + 4, "dropped": 0, "failure": None}

    # W&B (offline): the run's .wandb log read back with W&B's own reader, every series and its steps.
    wandb_log = read_log(offline_log(run_dir / "wandb" / run_dir.name))
    same({t: p for t, p in wandb_log.series.items() if not t.startswith("eval/")}, train)
    same({t: p for t, p in wandb_log.series.items() if t.startswith("eval/")}, evals)
    assert summary["tracking"]["wandb"] == {"written": STEPS + 4, "dropped": 0, "failure": None}
    assert wandb_log.run["display_name"] == "quickstart" and wandb_log.run["project"] == "tracked"
    assert wandb_log.config["trainer.steps"] == str(STEPS) and wandb_log.config["tracking.wandb.mode"] == "offline"
    assert wandb_log.exit_code == 0

    # MLflow: what reached the server before it stopped, read back with MLflow's own client.
    mlflow = summary["tracking"]["mlflow"]
    assert stopped_after is not None and stopped_after < STEPS and read_back is not None
    assert mlflow["written"] >= 1 and mlflow["dropped"] >= 1 and mlflow["failure"]
    assert mlflow["written"] + mlflow["dropped"] == STEPS + 4
    assert 1 <= dropped_metric <= mlflow["dropped"]
    assert read_back["name"] == "quickstart" and read_back["params"]["trainer.steps"] == str(STEPS)
    assert read_back["params"]["tracking.mlflow.experiment"] == "tracked"
    steps_read = [s for s, _ in read_back["metrics"]["train/reward_mean"]]
    assert steps_read == list(range(1, len(steps_read) + 1)) and 1 <= len(steps_read) <= stopped_after
    for tag in train:
        # A record the server's stop cut short may have reached it for some series and not others.
        got = read_back["metrics"].get(tag, [])  # a series may start after the steps read (staleness/0)
        last = max((s for s, _ in got), default=0)
        want = [p for p in train[tag] if p[0] <= last]
        assert last <= stopped_after, tag
        assert [s for s, _ in got] == [s for s, _ in want], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6, abs=1e-9), tag
    assert read_back["metrics"]["eval/rotate"][0] == [0, pytest.approx(evals["eval/rotate"][0][1])]
