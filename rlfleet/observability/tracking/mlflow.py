"""An MLflow tracking server over its REST API (aiohttp, every call bounded): no MLflow package in the run.

open: the experiment (created when missing), a run named after the TrainingRun, the flattened spec as
params (100 a batch, values cut to MLflow's 6000 characters), resumed where it stopped when tried again;
log: one `runs/log-batch` per record; close: the run's status (FINISHED, FAILED).
"""
from __future__ import annotations

import math
import time
import uuid
from collections.abc import Collection, Mapping
from typing import Any

import aiohttp

API = "/api/2.0/mlflow"
PARAM_VALUE_MAX = 6000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
OPEN_TAG = "rlfleet.openToken"
PARAM_KEY_MAX = 250


class MlflowError(Exception):
    pass


class MlflowTracker:
    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, *, timeout_s: float = 10.0,
                 tags: Mapping[str, str] | None = None):
        self.base = tracking_uri.rstrip("/") + API
        self.experiment = experiment
        self.run_name = run_name
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.open_token = uuid.uuid4().hex  # tags the run, so a retried open finds a run it made unawares
        self._create_sent = False
        self._params_logged: set[str] = set()  # param keys (as cut) the server has taken
        self._session: aiohttp.ClientSession | None = None

    async def _request(self, method: str, path: str, *, params: dict | None = None,
                       json: dict | None = None, missing_ok: bool = False) -> dict[str, Any] | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        async with self._session.request(method, self.base + path, params=params, json=json) as response:
            body = await response.json(content_type=None) if response.content_length != 0 else {}
            if response.status == 404 and missing_ok:
                return None
            if response.status >= 400:
                raise MlflowError(f"{method} {path}: HTTP {response.status}: {str(body)[:300]}")
            return body or {}

    async def open(self, params: Mapping[str, str]) -> None:
        """Idempotent: a retry after an open cut short (a bound, a failed call) resumes it, with the same
        experiment and run and only the params not yet logged, so one TrainingRun is one MLflow run."""
        if self.experiment_id is None:
            self.experiment_id = await self._experiment_id()
        if self.run_id is None:
            self.run_id = await self._run_id(self.experiment_id)
        await self._log_params(params)

    async def _experiment_id(self) -> str:
        # A create whose answer was lost is found here on the retry.
        found = await self._request("GET", "/experiments/get-by-name", params={"experiment_name": self.experiment},
                                    missing_ok=True)
        if found is not None:
            return str(found["experiment"]["experiment_id"])
        created = await self._request("POST", "/experiments/create", json={"name": self.experiment})
        assert created is not None
        return str(created["experiment_id"])

    async def _run_id(self, experiment_id: str) -> str:
        # A runs/create sent before may have made the run even though its answer never came: look for it
        # by this tracker's open tag before making another.
        if self._create_sent and (found := await self._find_run(experiment_id)) is not None:
            return found
        self._create_sent = True
        tags = {**self.tags, OPEN_TAG: self.open_token}
        run = await self._request("POST", "/runs/create", json={
            "experiment_id": experiment_id, "run_name": self.run_name, "start_time": _now_ms(),
            "tags": [{"key": k, "value": v} for k, v in tags.items()],
        })
        assert run is not None
        return str(run["run"]["info"]["run_id"])

    async def _find_run(self, experiment_id: str) -> str | None:
        found = await self._request("POST", "/runs/search", json={
            "experiment_ids": [experiment_id], "filter": f"tags.`{OPEN_TAG}` = '{self.open_token}'",
            "max_results": 1})
        runs = (found or {}).get("runs", [])
        return str(runs[0]["info"]["run_id"]) if runs else None

    async def _log_params(self, params: Mapping[str, str]) -> None:
        assert self.run_id is not None
        for batch in param_batches(params, self._params_logged):
            await self._request("POST", "/runs/log-batch", json={"run_id": self.run_id, "params": batch})
            self._params_logged.update(item["key"] for item in batch)

    async def log(self, step: int, scalars: Mapping[str, float]) -> None:
        assert self.run_id is not None, "open() first"
        stamp = _now_ms()
        items = [{"key": k, "value": v, "timestamp": stamp, "step": step} for k, v in sorted(scalars.items())]
        for i in range(0, len(items), METRICS_PER_BATCH):
            await self._request("POST", "/runs/log-batch",
                                json={"run_id": self.run_id, "metrics": items[i:i + METRICS_PER_BATCH]})

    async def close(self, status: str) -> None:
        try:
            if self.run_id is not None:
                await self._request("POST", "/runs/update",
                                    json={"run_id": self.run_id, "status": status, "end_time": _now_ms()})
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None


def param_batches(params: Mapping[str, str], logged: Collection[str] = ()) -> list[list[dict[str, str]]]:
    """The params not yet `logged` (keys as cut), as runs/log-batch bodies of at most PARAMS_PER_BATCH."""
    items = [{"key": k[:PARAM_KEY_MAX], "value": str(v)[:PARAM_VALUE_MAX]} for k, v in sorted(params.items())]
    items = [item for item in items if item["key"] not in logged]
    return [items[i:i + PARAMS_PER_BATCH] for i in range(0, len(items), PARAMS_PER_BATCH)]


def open_requests(n_params: int) -> int:
    """The most requests one `open` makes: the experiment looked up and created, the run created, the params
    in batches (a retry that searches for its run first has its experiment already: no more than that)."""
    return 3 + math.ceil(n_params / PARAMS_PER_BATCH)


def log_bound_s(request_timeout_s: float, n_scalars: int, slack_s: float = 1.0) -> float:
    """A bound on one record's `log`: its scalars go in batches of METRICS_PER_BATCH, each request bounded."""
    return max(1, math.ceil(n_scalars / METRICS_PER_BATCH)) * request_timeout_s + slack_s


def open_bound_s(request_timeout_s: float, n_params: int, slack_s: float = 1.0) -> float:
    """A bound on a whole `open`: each of its requests has `request_timeout_s` (aiohttp's own bound)."""
    return open_requests(n_params) * request_timeout_s + slack_s


def _now_ms() -> int:
    return int(time.time() * 1000)
