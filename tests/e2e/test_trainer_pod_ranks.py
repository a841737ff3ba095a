"""A trainer of several ranks on Kubernetes: one trainer pod that starts its ranks itself.

Real kube-apiserver + etcd (`control_plane`), the chart, the operator as a local process with the
chart's token, the node agent running the pods as local processes; one real SGLang engine pod and a
2-rank torch trainer (data parallel over gloo) in the trainer pod.
"""
from __future__ import annotations

import json
import time

import pytest
import yaml

from helpers.cluster import (
    REPO,
    apply,
    chart_installed,
    chart_operator,
    get_json,
    start_node_agent,
    stop_node_agent,
    wait_for,
)

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-ranks"
ENGINE_START_S = 600  # CPU engines start in 25-60 s alone; far slower on a busy 2-core machine


def two_rank_run(*, steps: int) -> dict:
    """The quickstart with a trainer of two data-parallel ranks, one engine, no eval, a few steps."""
    run = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    run["metadata"] = {"name": "ranks", "namespace": NS}
    spec = run["spec"]
    del spec["eval"]
    spec["trainer"].update(steps=steps, dataParallelSize=2, promptsPerStep=8, samplesPerPrompt=8)
    spec["rollout"]["replicas"] = 1
    spec["rollout"]["health"]["startupTimeoutSeconds"] = ENGINE_START_S
    return run


def run_status(cp) -> dict:
    return (get_json(cp, "trainingrun", "ranks", namespace=NS) or {}).get("status", {})


@pytest.mark.engines
@pytest.mark.timeout(1500)
def test_a_two_rank_trainer_pod_trains_to_succeeded_with_one_snapshot_per_step(control_plane, tmp_path_factory):
    from rlfleet.snapshot.format import MARKER_NAME, validate_snapshot

    cp = control_plane
    steps = 3
    data_dir = tmp_path_factory.mktemp("node")
    with chart_installed(cp, NS), chart_operator(cp, NS, tmp_path_factory.mktemp("operator")) as operator:
        agent = start_node_agent(cp, data_dir)
        try:
            started = time.monotonic()
            apply(cp, two_rank_run(steps=steps))

            def context() -> str:
                logs = list((data_dir / "logs").glob(f"{NS}_ranks-trainer_*/trainer.log"))
                return "\n".join([json.dumps(run_status(cp))[-1500:], operator.tail(), "\n".join(agent.tail(20)),
                                  logs[0].read_text()[-4000:] if logs else ""])

            pod = wait_for(lambda: get_json(cp, "pod", "ranks-trainer", namespace=NS), timeout=120,
                           what="the trainer pod", context=context)
            (container,) = pod["spec"]["containers"]
            assert container["resources"]["requests"]["cpu"] == "2"  # a core per rank
            final = wait_for(lambda: (s := run_status(cp)).get("phase") in ("Succeeded", "Failed") and s,
                             timeout=ENGINE_START_S + 600, interval=2, what="the run to finish", context=context)
            total_s = time.monotonic() - started
            assert final["phase"] == "Succeeded", json.dumps(final)[-3000:]
            assert final["step"] == steps and final["weightVersion"] == str(steps)
            assert final["trainer"] == {**final["trainer"], "ranks": 2, "ready": 2, "restarts": 0}

            trainer_log = cp.kubectl("logs", "ranks-trainer", "-n", NS).stdout  # what a user reads
            assert "starting 2 trainer ranks" in trainer_log, trainer_log[-3000:]
            assert "torch trainer: 2 rank(s) (tensor 1 x pipeline 1 x data 2) on cpu, gloo" in trainer_log

            # The same layout as a one-rank trainer's: one sealed HF snapshot per step on the claim.
            claim = data_dir / "claims" / NS / "ranks-snapshots"
            summary = json.loads((claim / "ranks-summary.json").read_text())
            assert summary["steps_completed"] == steps and summary["failure"] is None
            last = claim / f"step_{steps}"
            manifest = validate_snapshot(last, expected_step=steps)
            assert (last / MARKER_NAME).is_file() and (last / "config.json").is_file()
            assert manifest.step == steps
            print(f"\nfigures: 2-rank trainer pod, {steps} steps, Succeeded {total_s:.0f} s after apply")
        finally:
            cp.kubectl("delete", "trainingrun", "ranks", "-n", NS, "--wait=false", check=False)
            wait_for(lambda: not (get_json(cp, "pods", "-l", "rlfleet.io/run=ranks", namespace=NS) or {})
                     .get("items"), timeout=180, what="the run's pods to be gone")
            left = stop_node_agent(agent, data_dir)
            assert left == 0, f"the node agent left {left} pod process group(s) running"
