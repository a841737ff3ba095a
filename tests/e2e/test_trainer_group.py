"""A trainer across nodes on Kubernetes: a group of two trainer pods, two ranks in each, one cluster run.

Real kube-apiserver + etcd (`control_plane`, with garbage collection), the chart installed with helm,
the operator as a local process with the chart's ServiceAccount token, the node agent running every
pod as local processes (each on its own 127.0.0.N). The quickstart, sized down, with a torch trainer
of 4 data-parallel ranks over `nodes: 2` (gloo; ranks 0-1 in pod 0, 2-3 in pod 1, rendezvous on pod
0's IP read through the API) and one real SGLang engine pod, in `weightSync.mode: broadcast` (rank 0,
in pod 0, is rank 0 of the update group on its pod IP). At the first checkpoint rank 0 is held (SIGSTOP:
a step takes well under a second) while pod 1 is deleted, then let go: the group fails as one, the
operator replaces both pods (one restart, `--resume`), and the run goes on to Succeeded.
Asserted: status.trainer, one validated snapshot per step, every step broadcast with the
engine's version read back and its checksum matching, the NetworkPolicies, both pods' ranks (their
logs), and the group's removal with the run.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

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
from rlfleet.crds.managed import ReservedEnv

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-group"
RUN = "group"
ENGINE_START_S = 600  # CPU engines start in 25-60 s alone; far slower on a busy 2-core machine
STEPS = 5
TRAINER = {"app.kubernetes.io/component": "trainer", "rlfleet.io/run": RUN}
ENGINE = {"app.kubernetes.io/component": "engine", "rlfleet.io/fleet": f"{RUN}-rollout"}


def group_run() -> dict:
    """The quickstart with a trainer of 2 pods x 2 CPU ranks (data parallel 4), one engine, no eval."""
    run = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    run["metadata"] = {"name": RUN, "namespace": NS}
    spec = run["spec"]
    del spec["eval"]  # one engine pod: the rollout fleet's
    spec["trainer"].update(steps=STEPS, nodes=2, dataParallelSize=4, promptsPerStep=4, samplesPerPrompt=4,
                           maxRestarts=1)
    spec["rollout"].update(replicas=1, minReadyEngines=1)
    spec["rollout"]["health"]["startupTimeoutSeconds"] = ENGINE_START_S
    spec["weightSync"] = {"mode": "broadcast", "verifyEvery": 1, "transferTimeoutSeconds": 120}
    spec["checkpoint"] = {"intervalSteps": 1}
    return run


def pods(cp, labels: dict) -> list[dict]:
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    return sorted((get_json(cp, "pods", "-l", selector, namespace=NS) or {}).get("items", []),
                  key=lambda p: p["metadata"]["name"])


def names(items: list[dict]) -> list[str]:
    return [p["metadata"]["name"] for p in items]


def run_status(cp) -> dict:
    return (get_json(cp, "trainingrun", RUN, namespace=NS) or {}).get("status", {})


def command_of(pid: str) -> str:
    """`<pid>: <command line>` of a process, for a failure message."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: (gone)"
    return f"{pid}: {command[:300]}"


def namespace_of(pid: str) -> str | None:
    """The namespace of the pod a process runs for (its RLFLEET_POD_NAMESPACE), None when it has none or is gone."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{ReservedEnv.POD_NAMESPACE}=".encode()
    return next((v[len(prefix):].decode() for v in environ if v.startswith(prefix)), None)


def environ_of(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def parent_of(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None


def rank_process(pod: str, rank: int) -> int | None:
    """The pid of trainer rank `rank`, started by pod `pod`'s launcher (not a child of the rank's own)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        env = environ_of(entry.name)
        if (env.get(ReservedEnv.POD_NAME), env.get(ReservedEnv.POD_NAMESPACE), env.get("RANK")) != (pod, NS, str(rank)):
            continue
        parent = parent_of(entry.name)
        if parent is not None and environ_of(parent).get("RANK") != str(rank):
            return int(entry.name)
    return None


def checkpointed_steps(claim: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (claim / "checkpoints").glob("step_*/COMPLETE"))


class Listeners:
    """The local addresses where processes of `namespace`'s pods listen on `port`, seen by polling `ss` (which
    touches no socket) in a thread. Other listeners on the port (another test's processes on this machine)
    are kept apart, in `others`."""

    def __init__(self, port: int, namespace: str):
        self.port, self.namespace, self.seen, self._stop = port, namespace, set(), threading.Event()
        self.owners: dict[str, set[str]] = {}  # address -> the processes seen listening there (for a failure)
        self.others: dict[str, set[str]] = {}  # the same, for processes of no pod in `namespace`
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["ss", "-Htlnp", f"sport = :{self.port}"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                fields = line.split()
                if len(fields) < 4:
                    continue
                address = fields[3].rsplit(":", 1)[0]
                pids = re.findall(r"pid=(\d+)", line)
                ours = not pids or any(namespace_of(pid) == self.namespace for pid in pids)
                if ours:
                    self.seen.add(address)
                for pid in pids:
                    (self.owners if ours else self.others).setdefault(address, set()).add(command_of(pid))
            self._stop.wait(0.05)

    def __enter__(self) -> Listeners:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.mark.engines
@pytest.mark.timeout(2100)
def test_a_trainer_group_of_two_pods_trains_broadcasts_survives_losing_a_pod_and_succeeds(control_plane,
                                                                                        tmp_path_factory):
    from rlfleet.snapshot.format import MARKER_NAME, validate_snapshot

    cp = control_plane
    data_dir = tmp_path_factory.mktemp("node")
    claim = data_dir / "claims" / NS / f"{RUN}-snapshots"

    def pod_logs(pod: str) -> list[str]:
        """Every incarnation's trainer log of `pod`, oldest first."""
        found = sorted((data_dir / "logs").glob(f"{NS}_{pod}_*/trainer.log"), key=lambda p: p.stat().st_mtime)
        return [p.read_text(errors="replace") for p in found]

    with chart_installed(cp, NS), chart_operator(cp, NS, tmp_path_factory.mktemp("operator")) as operator:
        agent = start_node_agent(cp, data_dir, first_host=180)

        def context() -> str:
            return "\n".join([json.dumps(run_status(cp))[-1500:], cp.kubectl("get", "pods", "-n", NS, "-o", "wide",
                                                                              check=False).stdout,
                              operator.tail(), "\n".join(agent.tail(20)),
                              *(log[-3000:] for pod in (f"{RUN}-trainer-0", f"{RUN}-trainer-1")
                                for log in pod_logs(pod)[-1:])])

        try:
            started = time.monotonic()
            apply(cp, group_run())
            group = wait_for(lambda: len(found := pods(cp, TRAINER)) == 2 and found, timeout=120,
                             what="the trainer group's two pods", context=context)
            assert names(group) == [f"{RUN}-trainer-0", f"{RUN}-trainer-1"]
            for node, pod in enumerate(group):
                (container,) = pod["spec"]["containers"]
                assert pod["metadata"]["ownerReferences"][0]["kind"] == "TrainingRun"
                assert container["resources"]["requests"]["cpu"] == "2"  # a core per rank of the pod
                assert {"name": "RLFLEET_TRAINER_NODE", "value": str(node)} in container["env"]
            ports = {p["name"]: p["containerPort"] for p in group[0]["spec"]["containers"][0]["ports"]}
            assert ports["rendezvous"] == 29500 and ports["update-group"] == 29600

            # The policies select exactly the group's pods and the run's engine.
            wait_for(lambda: len(pods(cp, ENGINE)) == 1, timeout=120, what="the engine pod", context=context)
            trainer_policy = get_json(cp, "networkpolicy", f"{RUN}-trainer", namespace=NS)
            group_policy = get_json(cp, "networkpolicy", f"{RUN}-update-group", namespace=NS)
            assert trainer_policy is not None and group_policy is not None, context()
            assert names(pods(cp, trainer_policy["spec"]["podSelector"]["matchLabels"])) == names(group)
            from_engines, from_group, _metrics = trainer_policy["spec"]["ingress"]
            assert names(pods(cp, from_engines["from"][0]["podSelector"]["matchLabels"])) == [f"{RUN}-rollout-engine-0"]
            assert {"port": 29600, "protocol": "TCP"} in from_engines["ports"]
            assert names(pods(cp, from_group["from"][0]["podSelector"]["matchLabels"])) == names(group)
            assert {"port": 29500, "protocol": "TCP"} in from_group["ports"]
            assert names(pods(cp, group_policy["spec"]["podSelector"]["matchLabels"])) == [f"{RUN}-rollout-engine-0"]

            pod0_ip = wait_for(lambda: (get_json(cp, "pod", f"{RUN}-trainer-0", namespace=NS) or {})
                               .get("status", {}).get("podIP"), timeout=120, what="pod 0's address", context=context)

            # After the first complete checkpoint, pod 1 goes: the group fails as one and comes back whole.
            with Listeners(29500, NS) as rendezvous, Listeners(29600, NS) as update_group:
                # A step takes well under a second here: rank 0, which runs the run, is held (SIGSTOP) at its first
                # checkpoint while pod 1 goes, so the loss lands with steps left to train after it.
                rank0 = wait_for(lambda: rank_process(f"{RUN}-trainer-0", 0), timeout=ENGINE_START_S, interval=0.5,
                                 what="trainer rank 0's process", context=context)
                wait_for(lambda: checkpointed_steps(claim), timeout=ENGINE_START_S + 600, interval=0.02,
                         what="step 1's checkpoint", context=context)
                os.kill(rank0, signal.SIGSTOP)
                try:
                    lost_at_step = checkpointed_steps(claim)[-1]
                    assert lost_at_step + 1 < STEPS, f"rank 0 was held at step {lost_at_step}: too late for the test"
                    first_uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cp, TRAINER)}
                    cp.kubectl("delete", "pod", f"{RUN}-trainer-1", "-n", NS, "--wait=false")
                    # The node agent removes the pod once its processes are gone.
                    wait_for(lambda: (get_json(cp, "pod", f"{RUN}-trainer-1", namespace=NS) or {}).get("metadata", {})
                             .get("uid") != first_uids[f"{RUN}-trainer-1"], timeout=120, interval=0.5,
                             what="pod 1's processes to be gone", context=context)
                finally:
                    try:
                        os.kill(rank0, signal.SIGCONT)
                    except ProcessLookupError:
                        pass  # the group was already stopped with its pods
                phases: list = []

                def replaced() -> list[dict] | None:
                    phases.append(run_status(cp).get("phase"))
                    now = pods(cp, TRAINER)
                    fresh = [p for p in now if p["metadata"]["uid"] not in first_uids.values()]
                    return fresh if len(fresh) == 2 else None
                second = wait_for(replaced, timeout=300, interval=1, what="the whole group to be replaced",
                                  context=context)
                final = wait_for(lambda: (s := run_status(cp)).get("phase") in ("Succeeded", "Failed") and s,
                                 timeout=ENGINE_START_S + 600, interval=1, what="the run to finish",
                                 context=context)
            total_s = time.monotonic() - started
            assert final["phase"] == "Succeeded", context()
            assert "Failed" not in phases, phases
            assert final["step"] == STEPS and final["weightVersion"] == str(STEPS)
            # One restart for the group; its ranks summed over both pods.
            trainer = final["trainer"]
            assert (trainer["restarts"], trainer["failures"]) == (1, 1), trainer
            assert trainer["ranks"] == 4 and trainer["ready"] == 4, trainer
            assert trainer["lastFailure"]["reason"] in ("TrainerLost", "TrainerFailed"), trainer
            for pod in second:
                assert pod["metadata"]["annotations"]["rlfleet.io/restarts"] == "1"
                assert "--resume" in pod["spec"]["containers"][0]["command"]
            new_pod0_ip = (get_json(cp, "pod", f"{RUN}-trainer-0", namespace=NS) or {}).get("status", {}).get("podIP")
            # The group's store and the update group listened on pod 0's address only, never on pod 1's.
            pod0_ips = {pod0_ip, new_pod0_ip}
            for listeners in (rendezvous, update_group):
                assert listeners.seen and listeners.seen <= pod0_ips, (listeners.port, pod0_ips, listeners.owners,
                                                                       listeners.others, context())

            # Both pods ran their ranks, in both incarnations (each pod's log shows its local rank 0).
            logs0, logs1 = pod_logs(f"{RUN}-trainer-0"), pod_logs(f"{RUN}-trainer-1")
            assert len(logs0) == 2 and len(logs1) == 2, (len(logs0), len(logs1))
            for log in logs0:
                assert "node 0 of 2: starting trainer ranks 0-1 of 4" in log, log[-3000:]
            assert "torch trainer: 4 rank(s) (tensor 1 x pipeline 1 x data 4) on cpu, gloo" in logs0[-1]
            for log in logs1:
                assert "node 1 of 2: starting trainer ranks 2-3 of 4" in log, log[-3000:]
                assert "trainer rank 2 of 4 (node 1, local rank 0): following rank 0" in log, log[-3000:]
            assert f"trainer rank 2 of 4 (node 1, local rank 0): stopped after step {STEPS}" in logs1[-1]
            resumed = re.search(r"resuming from checkpoint step (\d+)", logs0[-1])
            assert resumed and 1 <= int(resumed.group(1)) <= lost_at_step + 1, logs0[-1][-3000:]

            # One sealed, valid HF snapshot per step; every step broadcast and read back.
            summary = json.loads((claim / f"{RUN}-summary.json").read_text())
            assert summary["steps_completed"] == STEPS and summary["failure"] is None
            assert summary["resumed_from"] == [int(resumed.group(1))]
            for step in range(1, STEPS + 1):
                snapshot = claim / f"step_{step}"
                if step == STEPS or (snapshot / MARKER_NAME).is_file():
                    assert validate_snapshot(snapshot, expected_step=step).step == step
                sync = summary["weight_sync_per_step"][str(step)]
                assert sync["mode"] == "broadcast" and sync["fallback"] is None, (step, sync)
                assert sync["bytes_broadcast"] > 0 and sync["checksums"] == {"match": 1}, (step, sync)
                assert summary["engine_versions_per_step"][str(step)] == {"0": str(step)}, step
            assert "sync ok broadcast" in logs0[-1], logs0[-1][-3000:]
            print(f"\nfigures: 2 pods x 2 ranks, {STEPS} steps, pod 1 deleted at step {lost_at_step}, group "
                  f"replaced once, Succeeded {total_s:.0f} s after apply; per-step sync seconds "
                  f"{[summary['weight_sync_per_step'][str(s)]['seconds'] for s in range(1, STEPS + 1)]}")
        finally:
            cp.kubectl("delete", "trainingrun", RUN, "-n", NS, "--wait=false", check=False)
            # The run owns every pod of the group: garbage collection removes them all with it.
            wait_for(lambda: not (get_json(cp, "pods", "-l", f"rlfleet.io/run={RUN}", namespace=NS) or {})
                     .get("items"), timeout=180, what="the run's pods (the trainer group's included) to be gone")
            left = stop_node_agent(agent, data_dir)
            assert left == 0, f"the node agent left {left} pod process group(s) running"
