"""Serve the Prometheus registry over HTTP on the event loop (no exporter thread)."""
from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


class MetricsServer:
    def __init__(self, host: str = "0.0.0.0", port: int = 9400, registry=REGISTRY):
        self.host = host
        self.port = port
        self.registry = registry
        self._runner: web.AppRunner | None = None

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        # Port 0 asks the kernel for a free one: report what we got.
        server = site._server
        if isinstance(server, asyncio.Server) and server.sockets:
            self.port = server.sockets[0].getsockname()[1]
        return f"http://{self.host}:{self.port}/metrics"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
