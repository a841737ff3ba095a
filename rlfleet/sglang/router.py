"""Client of the sglang-router worker API (0.3.x): `POST /workers` (202, registration runs in the
background), `GET /workers`, `DELETE /workers/{uuid}`. Removal is by id, so URLs are mapped to ids
through the listing. The old `/add_worker` and `/remove_worker` routes are gone (404).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp

from rlfleet.sglang.errors import BadResponse, CallTimeout, ClientErrorStatus
from rlfleet.sglang.http import Reply, call, expect_dict

# A one-token generation: the cheapest request that proves the whole serving path (router, a worker,
# its model) answers.
ONE_TOKEN_PROBE: dict[str, Any] = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


def normalize_url(url: str) -> str:
    """The form worker URLs are compared in (the router echoes them without a trailing slash)."""
    return url.strip().rstrip("/")


@dataclass(frozen=True)
class RouterWorker:
    id: str
    url: str
    is_healthy: bool


def parse_workers(body: dict[str, Any]) -> list[RouterWorker]:
    """Pure: the worker list of a `GET /workers` body."""
    workers = body.get("workers")
    if not isinstance(workers, list):
        raise BadResponse(f"GET /workers: no 'workers' list in {str(body)[:300]}")
    parsed = []
    for entry in workers:
        if not isinstance(entry, dict) or "id" not in entry or "url" not in entry:
            raise BadResponse(f"GET /workers: malformed worker entry {str(entry)[:200]}")
        parsed.append(RouterWorker(id=str(entry["id"]), url=normalize_url(str(entry["url"])),
                                   is_healthy=bool(entry.get("is_healthy", False))))
    return parsed


class RouterClient:
    """Calls one sglang-router at `base_url`."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, timeout_s: float = 10.0):
        self.session = session
        self.base_url = normalize_url(base_url)
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"RouterClient({self.base_url})"

    async def _call(self, method: str, path: str, **kwargs) -> Reply:
        kwargs.setdefault("timeout_s", self.timeout_s)
        return await call(self.session, method, self.base_url + path, **kwargs)

    async def add_worker(self, url: str) -> str:
        """Queue a worker's registration (202) and return its id. Adding a URL twice returns the same id."""
        reply = await self._call("POST", "/workers", json_body={"url": normalize_url(url)})
        body = expect_dict(reply, "POST /workers")
        worker_id = body.get("worker_id")
        if not worker_id:
            raise BadResponse(f"POST /workers answered {reply.status} without worker_id: {reply.text[:300]}",
                              url=self.base_url + "/workers", status=reply.status)
        return str(worker_id)

    async def list_workers(self) -> list[RouterWorker]:
        """Registered workers (those still registering are not listed)."""
        return parse_workers(expect_dict(await self._call("GET", "/workers"), "GET /workers"))

    async def worker_ids_by_url(self) -> dict[str, str]:
        return {w.url: w.id for w in await self.list_workers()}

    async def remove_worker(self, worker_id: str) -> bool:
        """Queue a worker's removal; False when the router does not know the id (already gone)."""
        try:
            await self._call("DELETE", f"/workers/{worker_id}")
        except ClientErrorStatus as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def wait_listed(self, url: str, *, present: bool = True, timeout_s: float = 30.0,
                          poll_s: float = 0.2) -> float:
        """Wait until url is (or is no longer) in `GET /workers`; returns the seconds waited."""
        target = normalize_url(url)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout_s
        while True:
            listed = target in {w.url for w in await self.list_workers()}
            if listed == present:
                return loop.time() - started
            if loop.time() >= deadline:
                state = "listed" if present else "gone"
                raise CallTimeout(f"worker {target} not {state} after {timeout_s:g} s",
                                  method="GET", url=self.base_url + "/workers")
            await asyncio.sleep(poll_s)

    async def probe(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """One one-token generation through the router; its answer (meta_info.weight_version tells
        which weights served it). Raises CallError when the path does not serve."""
        return await self.generate(dict(ONE_TOKEN_PROBE), timeout_s=timeout_s)

    async def generate(self, payload: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        """POST /generate through the router (policy picks the worker)."""
        return expect_dict(await self._call("POST", "/generate", json_body=payload, timeout_s=timeout_s),
                           "router generate")
