"""A small aiohttp app on a free loopback port: a stand-in for an exporter or a scripted peer of a client
under test (not for SGLang or the router, which the tests run for real)."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from aiohttp import web


@contextlib.asynccontextmanager
async def serving(routes: Sequence[web.RouteDef]) -> AsyncIterator[str]:
    """Serve `routes` on 127.0.0.1 (a free port); yields the base URL, removes the server after."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
