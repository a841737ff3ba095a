"""Engines and routers started with the fleet's key refuse requests without it and serve the
orchestrator's clients, which send it on every call (rlfleet.sglang.http.client_session)."""
from __future__ import annotations

import aiohttp
import pytest

from rlfleet.sglang.engine import EngineClient, EngineTimeouts
from rlfleet.sglang.http import client_session, new_api_key
from rlfleet.sglang.router import ONE_TOKEN_PROBE, RouterClient

pytestmark = pytest.mark.engines

KEY = new_api_key()
TIMEOUT = aiohttp.ClientTimeout(total=60)
SOME_ID = "3c3583f5-ce82-4157-be44-c0a2cd1e4e8b"


async def _status(method: str, url: str, *, key: str | None = None, json_body: dict | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session, \
            session.request(method, url, json=json_body, headers=headers) as response:
        await response.read()
        return response.status


async def test_keyed_engine_and_router_refuse_strangers_and_serve_the_orchestrator(sglang_engines, sglang_router,
                                                                                   tiny_model):
    engine = await sglang_engines.start(api_key=KEY)
    router = await sglang_router.start(api_key=KEY)

    # A stranger on the network: no key, or a wrong one.
    for key in (None, new_api_key()):
        assert await _status("POST", engine.url + "/generate", key=key, json_body=ONE_TOKEN_PROBE) == 401
        assert await _status("GET", engine.url + "/model_info", key=key) == 401
        assert await _status("POST", engine.url + "/update_weights_from_disk", key=key,
                             json_body={"model_path": str(tiny_model)}) == 401
        assert await _status("POST", engine.url + "/pause_generation", key=key, json_body={"mode": "abort"}) == 401
        assert await _status("POST", router.url + "/workers", key=key, json_body={"url": "http://127.0.0.9:1"}) == 401
        assert await _status("GET", router.url + "/workers", key=key) == 401
        assert await _status("DELETE", router.url + f"/workers/{SOME_ID}", key=key) == 401
        assert await _status("POST", router.url + "/generate", key=key, json_body=ONE_TOKEN_PROBE) == 401
    # Probes (the kubelet's, the monitor's) need no key.
    assert await _status("GET", engine.url + "/health_generate") == 200
    assert await _status("GET", router.url + "/health") == 200

    # The orchestrator's clients: every call carries the key.
    async with client_session(KEY) as session:
        client = EngineClient(session, engine.url, EngineTimeouts(health=60))
        assert (await client.model_info()).weight_version == "0"
        result = await client.update_weights_from_disk(str(tiny_model), "1")
        assert result.success, result.message
        assert await client.weight_version() == "1"
        routed = RouterClient(session, router.url, timeout_s=30)
        await routed.add_worker(engine.url)
        await routed.wait_listed(engine.url, timeout_s=60)
        # Through the router to the keyed engine: the router sends the key on to its worker.
        answer = await routed.probe(timeout_s=60)
        assert answer["meta_info"]["weight_version"] == "1"
        worker_id = (await routed.worker_ids_by_url())[engine.url]
        assert await routed.remove_worker(worker_id)
        await routed.wait_listed(engine.url, present=False, timeout_s=30)
