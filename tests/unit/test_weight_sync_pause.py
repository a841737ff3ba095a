"""The broadcast's pause over real loopback sockets (no engine: what is tested is how its failures are
told apart): an engine whose port refuses the connection is gone (marked dead as unreachable, not wedged),
one that accepts and never answers is wedged, one that answers is paused."""
from __future__ import annotations

import socket

import pytest
from aiohttp import web

from helpers.http_app import serving
from rlfleet.crds.specs import WeightSyncSpec
from rlfleet.orchestrator.fleet import broadcast_plan as plan
from rlfleet.orchestrator.fleet.backend import EngineSlot, EngineState
from rlfleet.orchestrator.fleet.update_group import TransferFailed
from rlfleet.orchestrator.fleet.weight_sync import WeightSync
from rlfleet.sglang.engine import EngineClient
from rlfleet.sglang.http import client_session
from rlfleet.util.ports import free_port


def slot(index: int, url: str) -> EngineSlot:
    return EngineSlot(slot=index, url=url, state=EngineState.ALIVE, incarnation=1, restarts=0)


async def test_a_pause_tells_an_engine_gone_from_one_wedged():
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)

    async def pause(_request: web.Request) -> web.Response:
        return web.json_response({})

    try:
        async with serving([web.post("/pause_generation", pause)]) as answering, client_session() as session:
            sync = WeightSync(None, None, spec=WeightSyncSpec(mode="broadcast", transfer_timeout_seconds=1),  # type: ignore[arg-type]
                              engine_client=lambda url: EngineClient(session, url), fleet="f")
            engines = [slot(0, f"http://127.0.0.1:{free_port()}"),  # nothing listens: refused
                       slot(1, f"http://127.0.0.1:{silent.getsockname()[1]}"), slot(2, answering)]
            paused: list[EngineSlot] = []
            with pytest.raises(TransferFailed, match="pause_generation") as caught:
                await sync._pause_all(engines, plan.StepBounds(1.0), paused)
        assert caught.value.gone == (0,) and caught.value.wedged == (1,)
        assert paused == [engines[2]]
    finally:
        silent.close()
