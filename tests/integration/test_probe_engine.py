"""The health-probe client and the monitor against a real SGLang engine (uvicorn over HTTP/1.1)."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from helpers.engines import EngineProcess
from rlfleet.crds.specs import HealthSpec
from rlfleet.orchestrator.fleet.monitor import HealthMonitor, ProbeTarget
from rlfleet.sglang.errors import ConnectionRefused
from rlfleet.sglang.probe import HealthProbeClient
from rlfleet.util.ports import allocate_endpoint

pytestmark = pytest.mark.engines

# SGLang's /health_generate runs a one-token generation and answers after at least 1 s; on a loaded
# CPU machine several seconds.
PROBE_TIMEOUT_S = 30.0
UVICORN_KEEP_ALIVE_S = 5.0  # SGLANG_TIMEOUT_KEEP_ALIVE's default


async def test_probes_reuse_one_connection_and_survive_uvicorns_idle_close(shared_engine: EngineProcess):
    client = HealthProbeClient()
    try:
        for _ in range(3):
            answer = await client.probe(shared_engine.url, PROBE_TIMEOUT_S)
            assert answer.status == 200
        assert client.connections_opened == 1  # kept alive across probes
        # uvicorn closes a connection idle for 5 s; the client notices and the next probe reconnects.
        await asyncio.sleep(UVICORN_KEEP_ALIVE_S + 1.5)
        assert client.open_connections() == 0
        assert (await client.probe(shared_engine.url, PROBE_TIMEOUT_S)).status == 200
        assert client.connections_opened == 2
    finally:
        client.close()


async def test_nothing_listening_where_an_engine_would_be_is_refused():
    host, port = allocate_endpoint()
    client = HealthProbeClient()
    try:
        with pytest.raises(ConnectionRefused):
            await client.probe(f"http://{host}:{port}", PROBE_TIMEOUT_S)
    finally:
        client.close()


async def test_the_monitor_keeps_a_healthy_engine_alive_over_one_connection(shared_engine: EngineProcess):
    spec = HealthSpec(interval_seconds=1, timeout_seconds=PROBE_TIMEOUT_S, failure_threshold=1)
    deaths: list[str] = []

    async def on_dead(target: ProbeTarget, reason: str) -> None:
        deaths.append(reason)

    def successes() -> float:
        return REGISTRY.get_sample_value("rlfleet_engine_probes_total",
                                         {"fleet": "it-probe", "result": "success"}) or 0.0

    before = successes()
    monitor = HealthMonitor(spec, targets=lambda: [ProbeTarget(0, 0, shared_engine.url)], on_dead=on_dead,
                            fleet="it-probe")
    await monitor.start()
    try:
        await asyncio.sleep(6)
    finally:
        await monitor.stop()
    assert deaths == []
    assert successes() - before >= 2
    assert monitor.client is not None and monitor.client.connections_opened == 1
