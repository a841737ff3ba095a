"""Smoke tests: a real SGLang CPU engine and a real sglang-router answer as users expect."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from helpers.engines import EngineProcess, perturbed_copy

pytestmark = pytest.mark.engines

HTTP_TIMEOUT = aiohttp.ClientTimeout(total=60)
PROMPT = {"text": "Hello", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session, session.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def _get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session, session.get(url) as response:
        return response.status, await response.json(content_type=None)


async def _greedy(url: str) -> dict:
    status, body = await _post(f"{url}/generate", PROMPT)
    assert status == 200, body
    return body


async def _load(engine: EngineProcess, model_path: Path, version: str) -> None:
    status, body = await _post(f"{engine.url}/update_weights_from_disk",
                               {"model_path": str(model_path), "weight_version": version})
    assert status == 200 and body["success"], body


async def test_engine_generates(shared_engine: EngineProcess) -> None:
    body = await _greedy(shared_engine.url)
    assert body["meta_info"]["completion_tokens"] == 16
    assert len(body["text"]) > 0
    assert body["meta_info"]["weight_version"] == "0"


async def test_update_weights_from_disk_reads_back_version(shared_engine: EngineProcess, tiny_model: Path,
                                                           tmp_path: Path) -> None:
    before = await _greedy(shared_engine.url)
    stepped = await asyncio.to_thread(perturbed_copy, tiny_model, tmp_path / "step_1", seed=1)
    try:
        await _load(shared_engine, stepped, "1")
        status, info = await _get(f"{shared_engine.url}/model_info")
        assert status == 200
        assert info["weight_version"] == "1"
        after = await _greedy(shared_engine.url)
        assert after["meta_info"]["weight_version"] == "1"
        assert after["output_ids"] != before["output_ids"], "new weights must change the greedy output"
    finally:
        # The engine is shared: put the original weights back.
        await _load(shared_engine, tiny_model, "0")
    status, info = await _get(f"{shared_engine.url}/model_info")
    assert info["weight_version"] == "0"
    restored = await _greedy(shared_engine.url)
    assert restored["output_ids"] == before["output_ids"]


async def test_router_adds_worker_and_routes_generate(shared_engine: EngineProcess, sglang_router) -> None:
    router = await sglang_router.start()
    status, body = await _post(f"{router.url}/workers", {"url": shared_engine.url})
    assert status in (200, 201, 202), body

    deadline = time.monotonic() + 60
    while True:
        status, listing = await _get(f"{router.url}/workers")
        assert status == 200, listing
        healthy = [w for w in listing["workers"] if w.get("url") == shared_engine.url and w.get("is_healthy")]
        if healthy:
            break
        assert time.monotonic() < deadline, f"worker never became healthy in the router: {listing}"
        await asyncio.sleep(0.5)

    direct = await _greedy(shared_engine.url)
    routed = await _greedy(router.url)
    assert routed["output_ids"] == direct["output_ids"]
