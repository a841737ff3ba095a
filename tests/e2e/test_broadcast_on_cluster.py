"""Broadcast weight sync on the dev cluster: the trainer pod is rank 0 of the update group on its pod IP.

The chart installed with helm, the operator with the chart's ServiceAccount token, the node agent
running the trainer pod and one real SGLang engine pod (each on its own 127.0.0.N). A short run in
`weightSync.mode: broadcast` must reach Succeeded with every step broadcast (not the disk fallback), each
step's version read back from the engine and its served weights' checksum matching the trainer's; the
update group's NetworkPolicies must exist and select exactly the run's trainer and rollout engine.
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from helpers.cluster import (
    apply,
    chart_installed,
    chart_operator,
    get_json,
    start_node_agent,
    stop_node_agent,
    wait_for,
)

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-bcast"
RUN = "bcast"
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
ENGINE_START_S = 600  # CPU engines start in 25-60 s alone; far slower on a busy 2-core machine
STEPS = 3


@pytest.fixture(scope="module")
def node_agent(control_plane, tmp_path_factory):
    with chart_installed(control_plane, NS):
        data_dir = tmp_path_factory.mktemp("bcast-node")
        agent = start_node_agent(control_plane, data_dir, first_host=170)
        try:
            with chart_operator(control_plane, NS, tmp_path_factory.mktemp("bcast-operator")) as op:
                yield agent, op
        finally:
            left = stop_node_agent(agent, data_dir)
            assert left == 0, f"the node agent left {left} pod process group(s) running"


def broadcast_run() -> dict:
    run = yaml.safe_load(QUICKSTART.read_text())
    run["metadata"] = {"name": RUN, "namespace": NS}
    spec = run["spec"]
    spec["trainer"].update(steps=STEPS, promptsPerStep=4, samplesPerPrompt=4)
    spec["rollout"].update(replicas=1, minReadyEngines=1)
    spec["rollout"]["health"]["startupTimeoutSeconds"] = ENGINE_START_S
    spec["weightSync"] = {"mode": "broadcast", "verifyEvery": 1, "transferTimeoutSeconds": 120}
    del spec["eval"]  # one engine pod: the rollout fleet's
    return run


def pods(cp, selector: dict) -> list[str]:
    labels = ",".join(f"{k}={v}" for k, v in selector["matchLabels"].items())
    return sorted(p["metadata"]["name"] for p in (get_json(cp, "pods", "-l", labels, namespace=NS) or {})
                  .get("items", []))


class Listeners:
    """The local addresses that listen on `port`, seen by polling `ss` (which touches no socket) in a thread."""

    def __init__(self, port: int):
        self.port, self.seen, self._stop = port, set(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["ss", "-Htln", f"sport = :{self.port}"], capture_output=True, text=True).stdout
            self.seen.update(line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip())
            self._stop.wait(0.05)

    def __enter__(self) -> Listeners:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_status(cp) -> dict:
    return (get_json(cp, "trainingrun", RUN, namespace=NS) or {}).get("status", {})


@pytest.mark.engines
@pytest.mark.timeout(1500)
def test_a_broadcast_run_on_the_cluster_succeeds_over_the_update_group(control_plane, node_agent):
    cp = control_plane
    agent, operator = node_agent
    started = time.monotonic()
    apply(cp, broadcast_run())

    def trainer_log() -> str:
        logs = list((agent.log_path.parent / "logs").glob(f"{NS}_{RUN}-trainer_*/trainer.log"))
        return logs[0].read_text() if logs else ""

    def context() -> str:
        return "\n".join([json.dumps(run_status(cp))[-1500:], cp.kubectl("get", "pods", "-n", NS, "-o", "wide",
                                                                          check=False).stdout,
                          agent.tail(), operator.tail(), trainer_log()[-4000:]])

    try:
        # The policies exist before the trainer pod runs, and select exactly its pods.
        wait_for(lambda: len(pods(cp, {"matchLabels": {"app.kubernetes.io/component": "engine",
                                                       "rlfleet.io/fleet": f"{RUN}-rollout"}})) == 1,
                 timeout=120, what="the engine pod", context=context)
        trainer_policy = get_json(cp, "networkpolicy", f"{RUN}-trainer", namespace=NS)
        group_policy = get_json(cp, "networkpolicy", f"{RUN}-update-group", namespace=NS)
        assert trainer_policy is not None and group_policy is not None, context()
        assert pods(cp, trainer_policy["spec"]["podSelector"]) == [f"{RUN}-trainer"]
        assert pods(cp, group_policy["spec"]["podSelector"]) == [f"{RUN}-rollout-engine-0"]
        rendezvous, _metrics = trainer_policy["spec"]["ingress"]
        assert pods(cp, rendezvous["from"][0]["podSelector"]) == [f"{RUN}-rollout-engine-0"]
        assert {"port": 29600, "protocol": "TCP"} in rendezvous["ports"]
        assert pods(cp, group_policy["spec"]["ingress"][0]["from"][0]["podSelector"]) == [f"{RUN}-rollout-engine-0"]
        trainer_pod = get_json(cp, "pod", f"{RUN}-trainer", namespace=NS)
        assert {"name": "update-group", "containerPort": 29600, "protocol": "TCP"} in \
            trainer_pod["spec"]["containers"][0]["ports"]

        pod_ip = wait_for(lambda: (get_json(cp, "pod", f"{RUN}-trainer", namespace=NS) or {}).get("status", {})
                          .get("podIP"), timeout=120, what="the trainer pod's address", context=context)

        with Listeners(29600) as listeners:
            final = wait_for(lambda: (s := run_status(cp)).get("phase") in ("Succeeded", "Failed") and s,
                             timeout=ENGINE_START_S + 600, interval=1, what="the run to finish", context=context)
        # Rank 0's store listened on exactly the trainer pod's address and declared port, on no other.
        assert listeners.seen == {pod_ip}, listeners.seen
        total_s = time.monotonic() - started
        assert final["phase"] == "Succeeded", context()
        assert final["step"] == STEPS and final["weightVersion"] == str(STEPS)

        claim_dir = agent.log_path.parent / "claims" / NS / f"{RUN}-snapshots"
        summary = json.loads((claim_dir / f"{RUN}-summary.json").read_text())
        assert summary["steps_completed"] == STEPS and summary["failure"] is None
        for step in range(1, STEPS + 1):
            sync = summary["weight_sync_per_step"][str(step)]
            # Broadcast, not the disk fallback; the engine read the version back and serves the trainer's bytes.
            assert sync["mode"] == "broadcast" and sync["fallback"] is None, (step, sync)
            assert sync["bytes_broadcast"] > 0 and sync["checksums"] == {"match": 1}, (step, sync)
            assert summary["engine_versions_per_step"][str(step)] == {"0": str(step)}, step
        log = trainer_log()
        assert "sync ok broadcast" in log, log[-3000:]
        print(f"\nfigures: Succeeded {total_s:.0f} s after apply; trainer pod {pod_ip}; per-step sync seconds "
              f"{[summary['weight_sync_per_step'][str(s)]['seconds'] for s in range(1, STEPS + 1)]}")
    finally:
        cp.kubectl("delete", "trainingrun", RUN, "-n", NS, "--wait=false", check=False)
        wait_for(lambda: not (get_json(cp, "pods", "-l", f"rlfleet.io/run={RUN}", namespace=NS) or {}).get("items"),
                 timeout=180, what="the run's pods to be gone")
