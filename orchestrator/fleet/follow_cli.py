"""`rlfleet follow-engines`: keep a fleet of no run's router routing to the fleet's Ready engine pods.

The operator runs it as the second container of such a fleet's router pod (`operator/builders.py`), with
the `rlfleet-router` account (it reads pods) and the fleet's key in $RLFLEET_API_KEY. `GET /ready` on
`--health-host:--health-port` answers 200 while the router's workers are kept up to date, else 503 with
the reason (the container's readiness probe). It runs until SIGTERM or SIGINT.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from aiohttp import web

from rlfleet.crds.conventions import API_KEY_ENV, FOLLOWER_HEALTH_PORT
from rlfleet.kube.client import KubeClient
from rlfleet.orchestrator.fleet.engine_follower import EngineFollower, FollowedFleet
from rlfleet.sglang.http import client_session, fleet_connector
from rlfleet.sglang.router import RouterClient
from rlfleet.util.aio import stop_task

ROUTER_CALL_TIMEOUT_S = 10.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlfleet follow-engines", description=__doc__.splitlines()[0])
    p.add_argument("--namespace", required=True, help="the fleet's namespace")
    p.add_argument("--fleet", required=True, help="the fleet's name (its engine pods carry its label)")
    p.add_argument("--fleet-uid", required=True, help="the fleet's UID: only pods it controls are routed to")
    p.add_argument("--engine-port", type=int, required=True, help="the engines' HTTP port")
    p.add_argument("--router", required=True, help="the router's URL, e.g. http://$(POD_IP):30000")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between reconciles when no pod changes (default 5)")
    p.add_argument("--health-host", default="127.0.0.1", help="address of GET /ready (in a pod: $(POD_IP))")
    p.add_argument("--health-port", type=int, default=FOLLOWER_HEALTH_PORT,
                   help=f"port of GET /ready (default {FOLLOWER_HEALTH_PORT}; 0: none)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG, else in-cluster)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not 0 < args.engine_port < 65536:
        p.error(f"--engine-port must be a TCP port, got {args.engine_port}")
    if not 0 <= args.health_port < 65536:
        p.error(f"--health-port must be a TCP port or 0, got {args.health_port}")
    if args.interval <= 0:
        p.error(f"--interval must be positive, got {args.interval}")
    return args


async def amain(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    fleet = FollowedFleet(namespace=args.namespace, name=args.fleet, uid=args.fleet_uid,
                          engine_port=args.engine_port)
    async with await KubeClient.load(args.kubeconfig) as kube, \
            client_session(os.environ.get(API_KEY_ENV), connector=fleet_connector()) as session:
        follower = EngineFollower(kube, RouterClient(session, args.router, timeout_s=ROUTER_CALL_TIMEOUT_S), fleet,
                                  interval_s=args.interval)
        logging.getLogger(__name__).info("following the engine pods of %s/%s for the router at %s",
                                         args.namespace, args.fleet, args.router)
        health = await _serve_readiness(follower, args.health_host, args.health_port) if args.health_port else None
        try:
            following = asyncio.create_task(follower.run())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
            await stop_task(stopping)
            await stop_task(following)  # raises what the follower failed with, if it did
        finally:
            if health is not None:
                await health.cleanup()
    return 0


async def _serve_readiness(follower: EngineFollower, host: str, port: int) -> web.AppRunner:
    async def ready(_: web.Request) -> web.Response:
        ok, why = follower.ready()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    app = web.Application()
    app.router.add_get("/ready", ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(amain(args))
