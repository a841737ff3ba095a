"""`rlfleet operator` / `python -m rlfleet.operator`: run the Kopf operator.

    rlfleet operator --namespace team-a [--namespace team-b | --all-namespaces]
                     [--kubeconfig K] [--peering rlfleet [--priority N] | --standalone]
                     [--liveness http://0.0.0.0:8080/healthz] [--metrics-port 9402]
                     [--no-network-policy | --network-policy-metrics-from JSON]

Without --kubeconfig it uses $KUBECONFIG, else the pod's ServiceAccount. Two replicas are safe with
--peering (Kopf peering: the replica with the highest priority is active, the other waits); the
default priority is derived from the pod name so replicas never tie.

Each fleet gets a NetworkPolicy `<fleet>-engines`: its engine pods accept ingress only from the fleet's
router pods and its run's trainer pod (a fleet of no run: pods labelled `rlfleet.io/client: "true"`),
plus the peers of --network-policy-metrics-from (a JSON list of NetworkPolicy peers, e.g.
'[{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]') on the
engines' HTTP port, which serves /metrics. A second policy `<fleet>-router` admits only the run's trainer
(or the client pods) to the router, and those peers to its metrics port. --no-network-policy deletes the
policies it made.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import zlib

import kopf
from prometheus_client import start_http_server

from rlfleet.operator import builders as b
from rlfleet.operator.reconcile import Settings
from rlfleet.util.aio import stop_task


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlfleet operator", description="Run the rlfleet Kubernetes operator (Kopf).")
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", "-n", action="append", default=[], help="namespace to serve (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="serve every namespace")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG, else in-cluster)")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--peering", default=None, metavar="NAME", help="Kopf peering object name (HA replicas)")
    peering.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    p.add_argument("--priority", type=int, default=None, help="peering priority (default: from the pod name)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL ('' to disable)")
    p.add_argument("--metrics-port", type=int, default=9402, help="Prometheus metrics port (0 to disable)")
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument("--rlfleet-image", default=os.environ.get("RLFLEET_IMAGE", b.DEFAULT_RLFLEET_IMAGE),
                   help="image that runs `rlfleet` (tiny-model init containers)")
    p.add_argument("--follower-image", default=os.environ.get("RLFLEET_OPERATOR_IMAGE", b.DEFAULT_OPERATOR_IMAGE),
                   help="image that runs `rlfleet follow-engines` beside a fleet of no run's router (the "
                   "operator's own image: it needs none of the trainer's packages)")
    p.add_argument("--network-policy", action=argparse.BooleanOptionalAction, default=True,
                   help="give each fleet a NetworkPolicy admitting only its router and trainer to its engines")
    p.add_argument("--network-policy-metrics-from", type=_peers, default=[], metavar="JSON",
                   help="JSON list of NetworkPolicy peers that may also reach the engines' HTTP port (/metrics)")
    p.add_argument("--workload-rbac", "--trainer-rbac", dest="workload_rbac", action=argparse.BooleanOptionalAction,
                   default=False, help="create the accounts of the pods it creates (the trainer's; a fleet of no "
                   "run's router's) with their Role and RoleBinding in each namespace that needs one "
                   "(cluster-wide installs)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.priority is None:
        # Distinct per replica: equal priorities would make both replicas pause.
        args.priority = 100 + zlib.crc32(os.environ.get("POD_NAME", str(os.getpid())).encode()) % 10000
    return args


def _peers(text: str) -> list[dict]:
    try:
        return b.network_peers(json.loads(text or "[]"))
    except (json.JSONDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"not a JSON list of NetworkPolicy peers: {e}") from None


async def amain(args: argparse.Namespace) -> int:
    from rlfleet.operator import handlers  # noqa: F401 - registers the handlers

    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # Kopf's own login reads it
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    settings = Settings(rlfleet_image=args.rlfleet_image, follower_image=args.follower_image,
                        network_policy=args.network_policy,
                        network_policy_metrics_from=tuple(args.network_policy_metrics_from),
                        workload_rbac=args.workload_rbac)
    memo = kopf.Memo(kubeconfig=args.kubeconfig, settings=settings)
    flag: asyncio.Future[None] = asyncio.Future()
    setter = asyncio.create_task(_set_when(stop, flag))
    try:
        await kopf.operator(
            clusterwide=args.all_namespaces,
            namespaces=args.namespace,
            standalone=args.standalone or args.peering is None,
            peering_name=args.peering,
            priority=args.priority,
            liveness_endpoint=args.liveness or None,
            memo=memo,
            stop_flag=flag,
        )
    finally:
        await stop_task(setter)
    return 0


async def _set_when(event: asyncio.Event, flag: asyncio.Future) -> None:
    await event.wait()
    if not flag.done():
        flag.set_result(None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    level = logging.getLevelName(args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if level > logging.DEBUG:  # one "Handler ... succeeded" line per watch event is noise at scale
        logging.getLogger("kopf.objects").setLevel(max(level, logging.WARNING))
    return asyncio.run(amain(args))


if __name__ == "__main__":
    raise SystemExit(main())
