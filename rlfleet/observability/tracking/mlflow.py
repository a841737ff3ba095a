"""An MLflow tracking server over its REST API (aiohttp, every call bounded): no MLflow package in the run.

open: the experiment (created when missing), a run named after the TrainingRun, the flattened spec as
params (100 a batch, values cut to MLflow's 6000 characters); log: one `runs/log-batch` per record;
close: the run's status (FINISHED, FAILED).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import aiohttp

API = "/api/2.0/mlflow"
PARAM_VALUE_MAX = 6000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000


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
        found = await self._request("GET", "/experiments/get-by-name", params={"experiment_name": self.experiment},
                                    missing_ok=True)
        if found is None:
            created = await self._request("POST", "/experiments/create", json={"name": self.experiment})
            assert created is not None
            self.experiment_id = str(created["experiment_id"])
        else:
            self.experiment_id = str(found["experiment"]["experiment_id"])
        run = await self._request("POST", "/runs/create", json={
            "experiment_id": self.experiment_id, "run_name": self.run_name, "start_time": _now_ms(),
            "tags": [{"key": k, "value": v} for k, v in self.tags.items()],
        })
        assert run is not None
        self.run_id = str(run["run"]["info"]["run_id"])
        items = [{"key": k[:250], "value": str(v)[:PARAM_VALUE_MAX]} for k, v in sorted(params.items())]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            await self._request("POST", "/runs/log-batch",
                                json={"run_id": self.run_id, "params": items[i:i + PARAMS_PER_BATCH]})

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


def _now_ms() -> int:
    return int(time.time() * 1000)
