"""`rlfleet follow-engines` (the engine follower of a fleet of no run's router pod) says when it cannot do
its job: its readiness (`GET /ready`) is 503 with the reason while it cannot read the pods or reach its
router, 200 once the router's workers are the fleet's Ready engines, and it stops at once on SIGTERM.

Real kube-apiserver + etcd (`control_plane`), the follower as a local process with a ServiceAccount token,
a real sglang-router (no engines: no engine pod is Ready, so the desired worker list is empty).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from helpers.cluster import wait_for
from rlfleet.operator.builders import ROUTER_RULES, build_router_rbac
from rlfleet.sglang.launch import build_router_args
from rlfleet.util.binaries import python_executable
from rlfleet.util.ports import free_port

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-follower"


def readiness(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()
    except OSError as e:
        return 0, str(e)


def test_the_follower_is_unready_with_the_reason_until_it_can_read_pods_and_reach_its_router(control_plane,
                                                                                            tmp_path):
    cp = control_plane
    kubeconfig = cp.service_account_kubeconfig(NS, "rlfleet-router")  # the account, no Role yet
    router_port, health_port, key = free_port(), free_port(), "k" * 32
    log = tmp_path / "follower.log"
    follower = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "follow-engines", "--namespace", NS, "--fleet", "f", "--fleet-uid",
         "u", "--engine-port", "30000", "--router", f"http://127.0.0.1:{router_port}", "--health-port",
         str(health_port), "--interval", "1"],
        env={**os.environ, "KUBECONFIG": str(kubeconfig), "RLFLEET_API_KEY": key},
        stdout=log.open("w"), stderr=subprocess.STDOUT)
    router = None
    try:
        status = wait_for(lambda: (s := readiness(health_port))[0] == 503 and "Forbidden" in s[1] and s,
                          timeout=30, interval=0.5, what="503 naming the refused pod list", context=log.read_text)
        assert "cannot list resource \"pods\"" in status[1], status

        # The chart's (and the operator's) Role for this account: it may read pods, nothing else.
        for obj in build_router_rbac(NS)[1:]:
            cp.kubectl("apply", "-f", "-", input=json.dumps(obj))
        assert json.loads(cp.kubectl("get", "role", "rlfleet-router", "-n", NS, "-o", "json").stdout)["rules"] == \
            list(ROUTER_RULES)
        status = wait_for(lambda: (s := readiness(health_port))[0] == 503 and "/workers" in s[1] and s,
                          timeout=30, interval=0.5, what="503 naming the unreachable router", context=log.read_text)
        assert "connection_refused" in status[1], status

        router = subprocess.Popen([python_executable(), *build_router_args(
            host="127.0.0.1", port=router_port, metrics_port=free_port(), api_key=key)],
            stdout=(tmp_path / "router.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: readiness(health_port) == (200, "the router's workers are the fleet's Ready engines"),
                 timeout=60, interval=0.5, what="the follower to be ready", context=log.read_text)

        follower.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert follower.wait(timeout=10) == 0
        print(f"\nfigures: the follower stopped {time.monotonic() - started:.2f} s after SIGTERM")
    finally:
        for process in (follower, router):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)
        cp.kubectl("delete", "namespace", NS, "--wait=false", check=False)
