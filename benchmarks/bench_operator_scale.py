"""Operator scale: N RolloutFleets x M slots on a real kube-apiserver (pods are created, not run).

    python -P benchmarks/bench_operator_scale.py [--fleets 100] [--slots 32]

Starts a local control plane, the CRDs and the operator (a process, admin credentials), creates the
fleets with one `kubectl apply`, and measures:

- time to converge: until every fleet's status lists M slots and M existing pods;
- the operator's own API requests (by verb) and reconciles, from its Prometheus metrics, during
  convergence and during a quiet resync window (nothing changes: a level-based operator that skips
  unchanged status writes makes no request);
- baseline, measured in the same run on the same objects: one "list-per-reconcile" resync pass as a
  naive controller does it (LIST the fleet's pods + PATCH its status, for every fleet).

Prints the figures, the per-fleet and per-pod numbers, and the ratio to the baseline.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rlfleet.devcluster.control_plane import ControlPlane
from rlfleet.util.ports import free_port

REPO = Path(__file__).resolve().parents[1]
NS = "bench"
RESYNC_WINDOW_S = 35.0  # a little more than the operator's 30 s resync


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^(rlfleet_operator_(?:api_requests|reconciles)_total)\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        out[f"{m.group(1)}{{{m.group(2)}}}"] = float(m.group(3))
    return out


def requests_by_verb(snapshot: dict[str, float]) -> dict[str, float]:
    return {re.search(r'verb="(\w+)"', k).group(1): v for k, v in snapshot.items() if "api_requests" in k}


def reconciles(snapshot: dict[str, float]) -> float:
    return sum(v for k, v in snapshot.items() if "reconciles_total" in k and 'kind="RolloutFleet"' in k)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def fleet_manifests(fleets: int, slots: int) -> str:
    docs = []
    for i in range(fleets):
        docs.append({"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
                     "metadata": {"name": f"fleet-{i:03d}", "namespace": NS},
                     "spec": {"replicas": slots, "minReadyEngines": 1,
                              "engine": {"modelPath": "/models/tiny", "device": "cpu"},
                              "health": {"startupTimeoutSeconds": 86400}}})
    return "\n---\n".join(json.dumps(d) for d in docs)


def converged(cp: ControlPlane, fleets: int, slots: int) -> int:
    """How many fleets report every slot with an existing pod."""
    out = cp.kubectl("get", "rolloutfleets", "-n", NS, "-o",
                     "jsonpath={range .items[*]}{.status.replicas}/{.spec.replicas}/{.status.engines[*].slot}|{end}",
                     timeout=120).stdout
    done = 0
    for item in out.split("|"):
        parts = item.split("/")
        if len(parts) == 3 and parts[0] == parts[1] == str(slots) and len(parts[2].split()) == slots:
            done += 1
    return done


def naive_resync_pass(cp: ControlPlane, fleets: int) -> tuple[float, int]:
    """A list-per-reconcile controller's resync: LIST each fleet's pods, PATCH its status. (seconds, requests)"""
    import asyncio

    from rlfleet.kube.client import PODS, KubeClient, Resource

    async def run() -> tuple[float, int]:
        async with await KubeClient.load(cp.kubeconfig) as kube:
            res = Resource("rlfleet.io", "v1alpha1", "rolloutfleets")
            started = time.perf_counter()
            for i in range(fleets):
                name = f"fleet-{i:03d}"
                pods = await kube.list(PODS, NS, label_selector=f"rlfleet.io/fleet={name}")
                await kube.merge_patch(res, name, {"status": {"readyReplicas": 0,
                                                              "replicas": len(pods["items"])}}, NS, sub="status")
            return time.perf_counter() - started, kube.total_requests

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleets", type=int, default=100)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1200)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rlfleet-bench-"))
    cp = ControlPlane(work / "cluster")
    operator = None
    try:
        cp.start()
        cp.kubectl("apply", "-f", str(REPO / "crds"))
        cp.kubectl("create", "namespace", NS)
        wait = time.monotonic() + 60
        while cp.kubectl("get", "sa", "default", "-n", NS, check=False).returncode != 0:
            if time.monotonic() > wait:
                raise RuntimeError("the namespace's default ServiceAccount never appeared")
            time.sleep(0.5)
        mport, lport = free_port(), free_port()
        with open(work / "operator.log", "wb") as log:  # the child keeps its own copy of the descriptor
            operator = subprocess.Popen(
                [sys.executable, "-P", "-m", "rlfleet.operator", "--kubeconfig", str(cp.kubeconfig), "-n", NS,
                 "--standalone", "--metrics-host", "127.0.0.1", "--metrics-port", str(mport),
                 "--liveness", f"http://127.0.0.1:{lport}/healthz", "--log-level", "WARNING"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                before = metrics(mport)
                break
            except OSError:
                if time.monotonic() > deadline or operator.poll() is not None:
                    raise RuntimeError("the operator did not start; see " + str(work / "operator.log")) from None
                time.sleep(0.5)

        started = time.monotonic()
        cp.kubectl("apply", "-f", "-", input=fleet_manifests(args.fleets, args.slots), timeout=300)
        applied_s = time.monotonic() - started
        done = 0
        while done < args.fleets:
            if time.monotonic() - started > args.timeout:
                raise RuntimeError(f"only {done}/{args.fleets} fleets converged in {args.timeout:g} s")
            time.sleep(2)
            done = converged(cp, args.fleets, args.slots)
        converge_s = time.monotonic() - started
        time.sleep(5)  # let the last status writes land
        after_converge = metrics(mport)
        conv = delta(after_converge, before)
        quiet_start = metrics(mport)
        time.sleep(RESYNC_WINDOW_S)
        quiet = delta(metrics(mport), quiet_start)
        naive_s, naive_requests = naive_resync_pass(cp, args.fleets)

        pods = args.fleets * args.slots
        conv_req, conv_rec = sum(requests_by_verb(conv).values()), reconciles(conv)
        quiet_req, quiet_rec = sum(requests_by_verb(quiet).values()), reconciles(quiet)
        print(f"operator scale: {args.fleets} RolloutFleets x {args.slots} slots = {pods} pods "
              f"(kube-apiserver + etcd, pods not run)")
        print(f"  kubectl apply of {args.fleets} fleets: {applied_s:.1f} s")
        print(f"  converged (every slot has its pod, every status written): {converge_s:.1f} s "
              f"= {converge_s / args.fleets * 1000:.0f} ms per fleet, {converge_s / pods * 1000:.1f} ms per pod")
        print(f"  convergence: {conv_rec:.0f} reconciles, {conv_req:.0f} API requests "
              f"({', '.join(f'{k} {v:.0f}' for k, v in sorted(requests_by_verb(conv).items()))})")
        print(f"    = {conv_req / max(conv_rec, 1):.2f} requests per reconcile, "
              f"{conv_req / args.fleets:.1f} per fleet, {conv_req / pods:.3f} per pod")
        print(f"  quiet resync window ({RESYNC_WINDOW_S:.0f} s): {quiet_rec:.0f} reconciles, {quiet_req:.0f} API "
              f"requests = {quiet_req / max(quiet_rec, 1):.3f} requests per reconcile")
        naive_per = naive_requests / args.fleets
        ours_per = quiet_req / max(quiet_rec, 1)
        print(f"  baseline (list-per-reconcile resync, same objects, same run): {naive_requests} requests for "
              f"{args.fleets} reconciles = {naive_per:.2f} per reconcile, {naive_s:.1f} s per pass")
        ratio = ours_per / naive_per if naive_per else float("nan")
        print(f"  ratio operator/baseline requests per steady-state reconcile: {ratio:.3f}")
        return 0
    finally:
        if operator is not None:
            operator.terminate()
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
