"""A real MLflow tracking server on loopback (sqlite backend), from the environment scripts/setup.sh
builds from requirements-mlflow.lock, and MLflow's own client to read a run back."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rlfleet.util.binaries import CACHE_DIR
from rlfleet.util.ports import free_port

LOCK = Path(__file__).resolve().parents[2] / "requirements-mlflow.lock"


def mlflow_env() -> Path:
    pyver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    digest = hashlib.sha256(LOCK.read_bytes() + f"{pyver}\n".encode()).hexdigest()[:12]
    env = CACHE_DIR / f"mlflow-py{pyver}-{digest}"
    assert (env / ".complete").is_file(), f"no MLflow server environment at {env}: run `make setup`"
    return env


class MlflowServer:
    def __init__(self, directory: Path, port: int | None = None):
        self.directory = directory
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180.0) -> MlflowServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / "server.log").open("a")
        self.proc = subprocess.Popen(
            [str(mlflow_env() / "bin" / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.directory / 'mlflow.db'}",
             "--default-artifact-root", str(self.directory / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": "", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, (self.directory / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            assert time.monotonic() < deadline, (self.directory / "server.log").read_text()[-3000:]
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


READ_RUN = """
import json, sys
from mlflow import MlflowClient
print("ready", flush=True)
for line in sys.stdin:
    url, experiment = line.split()
    client = MlflowClient(url)
    try:
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id]) if exp is not None else []
        if len(runs) != 1:
            raise LookupError(f"{len(runs)} runs in experiment {experiment}")
        (run,) = runs
        keys = sorted(run.data.metrics)
        print(json.dumps({"name": run.info.run_name, "status": run.info.status, "params": run.data.params, "metrics": {
            k: [[m.step, m.value] for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step)]
            for k in keys}}), flush=True)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


class MlflowReader:
    """MLflow's own client in the server's environment, imported ahead (it takes seconds), reading a run
    back when asked: `read(url, experiment)` -> name, status, params and every metric's history."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([str(mlflow_env() / "bin" / "python"), "-c", READ_RUN], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ""})

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready", "the MLflow client did not start"

    def read(self, url: str, experiment: str) -> dict:
        """The run, or {"error": ...} (no such experiment or run yet)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{url} {experiment}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the MLflow client exited"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
