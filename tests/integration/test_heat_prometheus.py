"""The heat guard's prometheus source against a real Prometheus: every node's DCGM exporter through one URL.

No GPU exists on the machines these tests run on, so no DCGM exporter can run: the scrape target is an
HTTP endpoint serving the exporter's text format (labels as dcgm-exporter 3.x writes them with its
Kubernetes pod mapping, on two nodes). What is tested is the rlfleet side: the PromQL it sends a real
Prometheus, how it reads the answer (the exporter's pod label kept as `exported_pod` behind a target
that has its own), which samples are which engine's, and a failing Prometheus.
"""
from __future__ import annotations

import contextlib

import aiohttp
import pytest
from aiohttp import web

from helpers.http_app import serving
from helpers.prometheus import LocalPrometheus
from rlfleet.crds.specs import HeatGuardSpec
from rlfleet.orchestrator.guards.heat_guard import EnginePods, build_heat_source
from rlfleet.orchestrator.guards.heat_sources import TemperatureReadError

FLEET = "grpo-rollout"


def exporter_text(temps: dict[tuple[str, str], float]) -> str:
    """DCGM_FI_DEV_GPU_TEMP lines: {(namespace/pod or "", hostname): celsius}."""
    lines = ["# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).", "# TYPE DCGM_FI_DEV_GPU_TEMP gauge"]
    for gpu, ((owner, host), celsius) in enumerate(temps.items()):
        labels = {"gpu": str(gpu), "UUID": f"GPU-{gpu:04d}", "device": f"nvidia{gpu}", "modelName": "NVIDIA H100",
                  "Hostname": host}
        if owner:
            namespace, pod = owner.split("/")
            labels.update(container="engine", namespace=namespace, pod=pod)
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"DCGM_FI_DEV_GPU_TEMP{{{text}}} {celsius}")
    return "\n".join(lines) + "\n"


@contextlib.asynccontextmanager
async def exporter_endpoint(state: dict):
    """Serve `state["temps"]` as an exporter's /metrics on loopback; yields the scrape target host:port."""
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=exporter_text(state["temps"]), content_type="text/plain")

    async with serving([web.get("/metrics", metrics)]) as url:
        yield url.removeprefix("http://")


def guard(url: str) -> HeatGuardSpec:
    return HeatGuardSpec.model_validate({"enabled": True, "source": {"type": "prometheus", "url": url}})


async def test_engines_on_two_nodes_read_through_one_prometheus(tmp_path):
    state: dict = {"temps": {
        ("rl/grpo-rollout-engine-0", "gpu-node-a"): 71.0,
        ("rl/grpo-rollout-engine-1", "gpu-node-b"): 86.0,
        ("rl/grpo-rollout-engine-1", "gpu-node-b2"): 80.0,  # a second GPU of slot 1's engine: its hottest counts
        ("other/grpo-rollout-engine-0", "gpu-node-c"): 99.0,  # a namesake in another namespace
        ("rl/someone-else", "gpu-node-a"): 95.0,
        ("", "gpu-node-a"): 60.0,  # a GPU no pod holds
    }}
    async with exporter_endpoint(state) as target, aiohttp.ClientSession() as session:
        # As a ServiceMonitor scrapes the exporter: the target's own pod and namespace labels.
        prometheus = LocalPrometheus(tmp_path, target, [], job="dcgm-exporter",
                                     target_labels={"pod": "nvidia-dcgm-exporter-x7k2p", "namespace": "gpu-operator"})
        await prometheus.start(session)
        try:
            scraped = await prometheus.wait_for(session, "DCGM_FI_DEV_GPU_TEMP", lambda r: len(r) == 6, timeout_s=30)
            assert {s["metric"].get("exported_pod") for s in scraped} >= {"grpo-rollout-engine-0", None}
            source = build_heat_source(guard(prometheus.url), FLEET, 2, EnginePods("rl"), session=session)
            assert source.name == "prometheus"
            assert await source.read() == {"grpo-rollout-0": 71.0, "grpo-rollout-1": 86.0}
            # Only the fleet's engine pods are asked for; the namesake of another namespace is named unmapped.
            assert source.unmapped_keys == ("other/grpo-rollout-engine-0",)

            state["temps"][("rl/grpo-rollout-engine-0", "gpu-node-a")] = 88.5
            await prometheus.wait_for(session, 'DCGM_FI_DEV_GPU_TEMP{exported_pod="grpo-rollout-engine-0", '
                                      'exported_namespace="rl"} == 88.5', bool)
            assert (await source.read())["grpo-rollout-0"] == 88.5
        finally:
            await prometheus.stop()
        # Prometheus gone: a read error the guard counts as a round without readings, not a crash.
        with pytest.raises(TemperatureReadError, match="Prometheus"):
            await source.read()


async def test_an_exporter_scraped_with_its_own_labels_is_read_too(tmp_path):
    """A target without pod labels of its own (honor_labels, a static config): the plain `pod` label."""
    state = {"temps": {("rl/grpo-rollout-engine-0", "gpu-node-a"): 77.0}}
    async with exporter_endpoint(state) as target, aiohttp.ClientSession() as session:
        prometheus = LocalPrometheus(tmp_path, target, [], job="dcgm-exporter")
        await prometheus.start(session)
        try:
            await prometheus.wait_for(session, 'DCGM_FI_DEV_GPU_TEMP{pod="grpo-rollout-engine-0"}', bool)
            source = build_heat_source(guard(prometheus.url), FLEET, 1, EnginePods("rl"), session=session)
            assert await source.read() == {"grpo-rollout-0": 77.0}
        finally:
            await prometheus.stop()
