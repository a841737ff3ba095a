"""Load generator: simulates the `/health_generate` endpoint of many SGLang engines for health benchmarks.

This is NOT an engine. It answers health probes for N simulated engines on a few aiohttp servers so
the prober can be measured at fleet scale on one machine. Most simulated engines share one port and
are told apart by path (`http://HOST:PORT/e/<i>`); engines that may crash get a port of their own,
because a crash must look like one: the port closes and connections are refused.

Faults (set over the control port, `POST /_loadgen/fault {"engine": i, "mode": ...}`):
- `crash`: close that engine's port and its open connections (process gone); only for engines with
  their own port;
- `hang`: accept the probe and never answer (a stopped scheduler);
- `blip`: hang each probe for `seconds`, then answer again (a slow moment of a healthy engine);
- `ok`: answer 200 at once.
The control answer carries the `time.monotonic()` at which the fault took effect (one clock for all
processes of this machine), so the benchmark can compute detection latency.

Run: python benchmarks/loadgen.py --engines 1000 --crashable 10 --host 127.0.0.1
It prints one JSON line {"control": URL, "engines": [URL, ...]} when ready, then serves until killed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

from aiohttp import web


class SimulatedEngines:
    """Fault state of every simulated engine and the servers that answer for them."""

    def __init__(self, host: str, engines: int, crashable: int):
        if crashable > engines:
            raise ValueError("crashable engines cannot outnumber engines")
        self.host = host
        self.count = engines
        self.crashable = crashable  # engines 0..crashable-1 have their own port
        self.mode: dict[int, str] = {}
        self.blip_until: dict[int, float] = {}
        self.urls: list[str] = []
        self._own_runners: dict[int, web.AppRunner] = {}
        self._runners: list[web.AppRunner] = []
        self.probes = 0

    async def _answer(self, engine: int) -> web.Response:
        self.probes += 1
        mode = self.mode.get(engine, "ok")
        if mode == "hang":
            await asyncio.Event().wait()  # until the prober gives up and the handler is cancelled
        if mode == "blip":
            remaining = self.blip_until.get(engine, 0.0) - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
        return web.Response(status=200)

    async def _shared_handler(self, request: web.Request) -> web.Response:
        engine = int(request.match_info["engine"])
        if not self.crashable <= engine < self.count:
            raise web.HTTPNotFound()
        return await self._answer(engine)

    async def _start_runner(self, app: web.Application, port: int) -> tuple[web.AppRunner, int]:
        # handler_cancellation: a probe the prober abandoned must not leave a hung handler behind.
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, port, backlog=1024)
        await site.start()
        bound = runner.addresses[0][1]
        return runner, bound

    async def start(self) -> None:
        for engine in range(self.crashable):
            app = web.Application()
            app.router.add_get("/health_generate", lambda _req, e=engine: self._answer(e))
            runner, port = await self._start_runner(app, 0)
            self._own_runners[engine] = runner
            self.urls.append(f"http://{self.host}:{port}")
        if self.count > self.crashable:
            app = web.Application()
            app.router.add_get("/e/{engine}/health_generate", self._shared_handler)
            runner, port = await self._start_runner(app, 0)
            self._runners.append(runner)
            self.urls += [f"http://{self.host}:{port}/e/{i}" for i in range(self.crashable, self.count)]

    async def set_fault(self, engine: int, mode: str, seconds: float = 0.0) -> float:
        if not 0 <= engine < self.count:
            raise ValueError(f"no engine {engine}")
        if mode == "crash":
            runner = self._own_runners.pop(engine, None)
            if runner is None:
                raise ValueError(f"engine {engine} has no port of its own (or crashed already)")
            at = time.monotonic()
            await runner.cleanup()  # closes the listener and every open connection
            return at
        if mode not in ("ok", "hang", "blip"):
            raise ValueError(f"unknown mode {mode!r}")
        self.mode[engine] = mode
        if mode == "blip":
            self.blip_until[engine] = time.monotonic() + seconds
        return time.monotonic()

    async def stop(self) -> None:
        for runner in [*self._own_runners.values(), *self._runners]:
            await runner.cleanup()


async def serve(args: argparse.Namespace) -> None:
    engines = SimulatedEngines(args.host, args.engines, args.crashable)
    await engines.start()

    async def fault(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            at = await engines.set_fault(int(body["engine"]), str(body["mode"]), float(body.get("seconds", 0)))
        except (KeyError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"at": at})

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response({"probes": engines.probes})

    control = web.Application()
    control.router.add_post("/_loadgen/fault", fault)
    control.router.add_get("/_loadgen/stats", stats)
    runner = web.AppRunner(control, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, 0)
    await site.start()
    port = runner.addresses[0][1]
    print(json.dumps({"control": f"http://{args.host}:{port}", "engines": engines.urls}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await engines.stop()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--crashable", type=int, default=10, help="engines 0..N-1 get a port of their own")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
