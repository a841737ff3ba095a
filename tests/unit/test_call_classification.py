"""Failure classification of HTTP calls over real loopback sockets.

What is under test is how transport outcomes (refused, timed out, closed without an answer, error
statuses, abort-in-200) are classified; the tiny servers here only produce those socket-level
outcomes. Real SGLang behaviour is covered by the integration tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp
import pytest
from aiohttp import web

from helpers.http_app import serving
from rlfleet.orchestrator.fleet.membership import plan_membership
from rlfleet.sglang.engine import EngineClient, raise_if_aborted
from rlfleet.sglang.errors import (
    CallTimeout,
    ClientErrorStatus,
    ConnectionClosed,
    ConnectionRefused,
    FailureKind,
    RequestAborted,
    ServerErrorStatus,
    ServiceUnavailable,
    classify_status,
)
from rlfleet.sglang.http import Reply, call
from rlfleet.sglang.router import RouterWorker, parse_workers


@pytest.fixture
async def http_server():
    """Start an aiohttp app on 127.0.0.1 and return its base URL (removed when the test ends)."""
    async with contextlib.AsyncExitStack() as servers:
        async def start(routes: list[web.RouteDef]) -> str:
            return await servers.enter_async_context(serving(routes))

        yield start


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_classes():
    assert classify_status(200) is None
    assert classify_status(503) is FailureKind.UNAVAILABLE
    assert classify_status(429) is FailureKind.CLIENT_ERROR
    assert classify_status(502) is FailureKind.SERVER_ERROR


async def test_refused(session):
    with pytest.raises(ConnectionRefused) as info:
        await call(session, "GET", f"http://127.0.0.1:{unused_port()}/health_generate", timeout_s=2)
    assert info.value.engine_gone


async def test_timeout_is_bounded(session, http_server):
    async def slow(request):
        await asyncio.sleep(2)  # longer than the call's bound; short so teardown need not wait
        return web.Response()

    base = await http_server([web.get("/health_generate", slow)])
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(CallTimeout) as info:
        await call(session, "GET", base + "/health_generate", timeout_s=0.3)
    assert loop.time() - started < 2
    assert not info.value.engine_gone and "0.3 s" in str(info.value)


async def test_closed_without_response(session):
    async def close_at_once(reader, writer):
        await reader.read(100)
        writer.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ConnectionClosed) as info:
            await call(session, "POST", f"http://127.0.0.1:{port}/update_weights_from_disk", timeout_s=2,
                       json_body={"model_path": "x"})
        assert info.value.engine_gone
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("status,error", [(503, ServiceUnavailable), (400, ClientErrorStatus),
                                          (404, ClientErrorStatus), (500, ServerErrorStatus)])
async def test_error_statuses(session, http_server, status, error):
    async def fail(request):
        return web.json_response({"error": "nope"}, status=status)

    base = await http_server([web.get("/x", fail)])
    with pytest.raises(error) as info:
        await call(session, "GET", base + "/x", timeout_s=2)
    assert info.value.status == status and "nope" in info.value.body


async def test_abort_in_200_is_an_error_for_generate(session, http_server):
    body = {"text": "ab", "output_ids": [1, 2],
            "meta_info": {"finish_reason": {"type": "abort", "message": "Aborted"}, "weight_version": "3"}}
    async def aborted(request):
        return web.json_response(body)

    base = await http_server([web.post("/generate", aborted)])
    client = EngineClient(session, base)
    with pytest.raises(RequestAborted, match="Aborted"):
        await client.generate({"text": "a"})
    assert (await client.generate({"text": "a"}, raise_on_abort=False))["text"] == "ab"


def test_raise_if_aborted_is_the_one_abort_in_200_rule():
    reply = Reply(status=200, text="{}", elapsed_s=0.1, headers={}, method="POST", url="http://e:1/generate")
    answered = {"text": "ab", "meta_info": {"finish_reason": {"type": "length"}}}
    assert raise_if_aborted(reply, answered) is answered
    assert raise_if_aborted(reply, {"text": "ab", "meta_info": {"finish_reason": None}})["text"] == "ab"
    with pytest.raises(RequestAborted, match="Aborted by pause") as info:
        raise_if_aborted(reply, {"meta_info": {"finish_reason": {"type": "abort", "message": "Aborted by pause"}}})
    assert info.value.status == 200 and info.value.url == "http://e:1/generate"
    with pytest.raises(RequestAborted, match="aborted"):
        raise_if_aborted(reply, {"meta_info": {"finish_reason": {"type": "abort"}}})


async def test_update_weights_400_is_a_result(session, http_server):
    refused = {"success": False, "num_paused_requests": 0,
               "message": "Weights were updated, but the cache was not flushed because requests are still "
                          "running or queued. Retract or finish them, then call /flush_cache."}
    seen = []

    async def update(request):
        seen.append(await request.json())
        return web.json_response(refused, status=400)

    base = await http_server([web.post("/update_weights_from_disk", update)])
    result = await EngineClient(session, base).update_weights_from_disk("/snap/step_2", "2")
    assert not result.success and result.status == 400 and result.swapped_but_not_flushed
    assert seen[0]["model_path"] == "/snap/step_2" and seen[0]["weight_version"] == "2"


async def test_control_calls_send_a_json_body(session, http_server):
    bodies = {}

    async def record(request):
        bodies[request.path] = await request.json()
        return web.json_response({"status": "ok"})

    base = await http_server([web.post("/pause_generation", record), web.post("/continue_generation", record)])
    client = EngineClient(session, base)
    await client.pause_generation("retract")
    await client.continue_generation()
    assert bodies == {"/pause_generation": {"mode": "retract"}, "/continue_generation": {"torch_empty_cache": False}}
    with pytest.raises(ValueError):
        await client.pause_generation("sideways")  # type: ignore[arg-type]  # an invalid mode, on purpose


def test_router_worker_listing_and_membership_plan():
    workers = parse_workers({"workers": [
        {"id": "a", "url": "http://127.0.0.2:1/", "is_healthy": True},
        {"id": "b", "url": "http://127.0.0.3:1", "is_healthy": False},
    ], "total": 2})
    assert workers[0] == RouterWorker("a", "http://127.0.0.2:1", True)
    plan = plan_membership(workers, ["http://127.0.0.2:1", "http://127.0.0.4:1/"])
    assert plan.add == ("http://127.0.0.4:1",)
    assert [w.id for w in plan.remove] == ["b"]


async def test_a_closed_connection_is_a_death_only_if_the_engine_does_not_answer_again(session, http_server):
    """A connection closed without an answer (e.g. a kept-alive connection the engine's server closed as it
    was reused) is not proof of death: the engine is asked again. A refused connection is proof."""
    from rlfleet.sglang.engine import gone_for_good

    async def model_info(request):
        return web.json_response({"weight_version": "7", "model_path": "/m"})

    answering = EngineClient(session, await http_server([web.get("/model_info", model_info)]))
    closed = ConnectionClosed("connection reset by peer", method="POST", url=answering.base_url + "/pause_generation")
    assert closed.engine_gone
    assert await gone_for_good(answering, closed) is False

    silent = EngineClient(session, f"http://127.0.0.1:{unused_port()}")
    assert await gone_for_good(silent, ConnectionClosed("reset", method="POST", url=silent.base_url)) is True

    refused = ConnectionRefused("refused", method="POST", url=answering.base_url + "/pause_generation")
    assert await gone_for_good(answering, refused) is True  # not asked again: a refusal is proof
