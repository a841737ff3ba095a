"""The operator end to end: Helm chart, RBAC, real SGLang engines run by the node agent, recovery, GC.

Real kube-apiserver + etcd + kube-controller-manager (`control_plane`), the chart installed with helm,
the operator as a local process with the chart's ServiceAccount token, and the node agent running
every pod as local processes on its own 127.0.0.N. At most two SGLang engines run at any time.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers.cluster import (
    CHART,
    OPERATOR_SA,
    SYSTEM_NS,
    OperatorProcess,
    apply,
    chart_installed,
    engine_pgid,
    fleet_api_key,
    get_json,
    helm,
    http_json,
    pod_held,
    start_node_agent,
    stop_node_agent,
    wait_for,
)

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-e2e"
ENGINE_START_S = 600  # CPU engines start in 25-60 s alone; far slower on a busy 2-core machine


@pytest.fixture(scope="module")
def installed(control_plane):
    with chart_installed(control_plane, NS):
        yield


@pytest.fixture(scope="module")
def operator_kubeconfig(control_plane, installed) -> Path:
    return control_plane.service_account_kubeconfig(SYSTEM_NS, OPERATOR_SA)


@pytest.fixture(scope="module")
def node_agent(control_plane, installed, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("node")
    agent = start_node_agent(control_plane, data_dir)
    yield agent
    left = stop_node_agent(agent, data_dir)
    assert left == 0, f"the node agent left {left} pod process group(s) running"


@pytest.fixture(scope="module")
def operator(operator_kubeconfig, node_agent, tmp_path_factory):
    op = OperatorProcess(operator_kubeconfig, NS, tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    op.stop()


def fleet_manifest(name: str, model: Path, *, replicas: int, extra_args=(), recovery=None) -> dict:
    return {
        "apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas, "minReadyEngines": 1,
            "engine": {"modelPath": str(model), "device": "cpu", "maxTotalTokens": 4096,
                       "extraArgs": list(extra_args)},
            "health": {"startupTimeoutSeconds": ENGINE_START_S},
            "recovery": {"maxRestartsPerEngine": 3, "maxRestartsPerRun": 10, "backoffBaseSeconds": 2,
                         "backoffMaxSeconds": 10, **(recovery or {})},
        },
    }


def fleet_status(cp, name: str) -> dict:
    return (get_json(cp, "rolloutfleet", name, namespace=NS) or {}).get("status", {})


def condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def engine_pods(cp, fleet: str, slot: int | None = None) -> list[dict]:
    selector = f"rlfleet.io/fleet={fleet},app.kubernetes.io/component=engine"
    if slot is not None:
        selector += f",rlfleet.io/slot={slot}"
    return (get_json(cp, "pods", "-l", selector, namespace=NS) or {}).get("items", [])


def events_of(cp, name: str) -> list[dict]:
    return (get_json(cp, "events", "--field-selector", f"involvedObject.name={name}", namespace=NS)
            or {}).get("items", [])


def diagnostics(cp, *processes) -> str:
    """What to print when a wait fails: the pods, then the last lines of the agent's and operator's logs."""
    pods = cp.kubectl("get", "pods", "-n", NS, "-o", "wide", check=False).stdout
    tails = [p.tail() for p in processes if p is not None]  # the node agent's: lines; the operator's: text
    return "\n".join([pods, *("\n".join(t) if isinstance(t, list) else t for t in tails)])


def delete_and_wait(cp, kind: str, name: str, pods_selector: str, *processes) -> None:
    cp.kubectl("delete", kind, name, "-n", NS, "--wait=false", check=False)
    wait_for(lambda: not (get_json(cp, "pods", "-l", pods_selector, namespace=NS) or {}).get("items"),
             timeout=180, what=f"{kind} {name}'s pods to be gone", context=lambda: diagnostics(cp, *processes))


def test_operator_token_is_least_privilege(control_plane, operator_kubeconfig):
    def as_operator(*args):
        return control_plane.kubectl(*args, kubeconfig=operator_kubeconfig, check=False)

    secrets = as_operator("get", "secrets", "-n", NS)
    assert secrets.returncode != 0 and "Forbidden" in secrets.stderr, secrets.stderr
    other_ns = as_operator("get", "pods", "-n", "default")
    assert other_ns.returncode != 0 and "Forbidden" in other_ns.stderr, other_ns.stderr
    assert as_operator("get", "rolloutfleets", "-n", NS).returncode == 0
    assert as_operator("auth", "can-i", "create", "pods", "-n", NS).stdout.strip() == "yes"
    assert as_operator("auth", "can-i", "delete", "rolloutfleets", "-n", NS).stdout.strip() == "no"
    assert as_operator("auth", "can-i", "get", "configmaps", "-n", NS).stdout.strip() == "no"
    # Fleet keys: the operator creates their Secrets; it can neither read nor change one.
    assert as_operator("auth", "can-i", "create", "secrets", "-n", NS).stdout.strip() == "yes"
    for verb in ("get", "list", "watch", "patch", "update", "delete"):
        assert as_operator("auth", "can-i", verb, "secrets", "-n", NS).stdout.strip() == "no", verb


@pytest.mark.engines
@pytest.mark.timeout(1200)
def test_a_run_whose_engine_always_fails_ends_failed_with_its_log_line_and_delete_collects_everything(
        control_plane, operator, node_agent, tiny_model):
    cp = control_plane
    started = time.monotonic()
    run = {
        "apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
        "metadata": {"name": "tr-bad", "namespace": NS},
        "spec": {"modelPath": str(tiny_model), "trainer": {"gpus": 0, "steps": 2},
                 "rollout": {"replicas": 1,
                             "engine": {"device": "cpu", "maxTotalTokens": 4096, "extraArgs": ["--no-such-flag"]},
                             "health": {"startupTimeoutSeconds": ENGINE_START_S},
                             "recovery": {"maxRestartsPerEngine": 1, "backoffBaseSeconds": 1}},
                 "weightSync": {"snapshotVolume": {"size": "1Gi"}}},
    }
    apply(cp, run)
    children = [("rolloutfleet", "tr-bad-rollout"), ("pod", "tr-bad-trainer"), ("pvc", "tr-bad-snapshots"),
                ("deployment", "tr-bad-rollout-router"), ("service", "tr-bad-rollout-router"),
                ("pod", "tr-bad-rollout-engine-0")]
    try:
        objs = wait_for(lambda: all(o := [get_json(cp, k, n, namespace=NS) for k, n in children]) and o,
                        timeout=120, what="the run's children")
        run_uid = get_json(cp, "trainingrun", "tr-bad", namespace=NS)["metadata"]["uid"]
        assert {o["metadata"]["ownerReferences"][0]["uid"] for o in objs[:3]} == {run_uid}
        table = cp.kubectl("get", "tr", "tr-bad", "-n", NS).stdout.split("\n")[0].split()
        assert table[:6] == ["NAME", "PHASE", "STEP", "WEIGHTS", "READY", "LAST"]

        status = wait_for(lambda: (s := run_status(cp, "tr-bad")).get("phase") == "Failed" and s, timeout=600,
                          interval=2, what="the run to fail",
                          context=lambda: json.dumps(fleet_status(cp, "tr-bad-rollout"))[-2000:])
        elapsed = time.monotonic() - started
        for failed in (condition(status, "Failed"), condition(fleet_status(cp, "tr-bad-rollout"), "Failed")):
            assert failed["reason"] == "EngineCrashLoop", failed
            assert "unrecognized arguments: --no-such-flag" in failed["message"], failed
            assert "exit code 2" in failed["message"], failed
        assert status["totalEngines"] == 1
        fleet = fleet_status(cp, "tr-bad-rollout")
        assert fleet["engines"][0]["state"] == "Failed" and fleet["engines"][0]["restarts"] == 1
        pods = engine_pods(cp, "tr-bad-rollout")
        assert len(pods) == 1 and pods[0]["status"]["phase"] == "Failed"  # kept for diagnosis
        reasons = {e["reason"] for e in events_of(cp, "tr-bad-rollout")}
        assert {"EngineDead", "RecreatingEngine", "RestartBudgetExhausted", "EngineCrashLoop"} <= reasons
        # The trainer saw the crash loop too and exited with it; no retry storm afterwards.
        trainer = wait_for(lambda: (p := get_json(cp, "pod", "tr-bad-trainer", namespace=NS))
                           and p["status"].get("phase") in ("Succeeded", "Failed") and p, timeout=120,
                           what="the trainer to exit", context=lambda: pod_log(node_agent, NS, "tr-bad-trainer",
                                                                               "trainer")[-3000:])
        assert trainer["status"]["phase"] == "Failed"
        assert "EngineCrashLoop" in pod_log(node_agent, NS, "tr-bad-trainer", "trainer")
        time.sleep(5)
        assert fleet_status(cp, "tr-bad-rollout")["restarts"] == 1
        print(f"\nfigures: crash loop detected and run Failed {elapsed:.0f} s after creation")
    finally:
        cp.kubectl("delete", "trainingrun", "tr-bad", "-n", NS, "--wait=false", check=False)

    def remaining() -> str:
        left = [(k, n, o["metadata"].get("finalizers"), o["metadata"].get("deletionTimestamp"))
                for k, n in children if (o := get_json(cp, k, n, namespace=NS))]
        return f"left: {left}"
    wait_for(lambda: not any(get_json(cp, k, n, namespace=NS) for k, n in children), timeout=180,
             what="garbage collection of the run's children", context=remaining)


@pytest.mark.engines
@pytest.mark.timeout(1800)
async def test_kubernetes_backend_marks_dead_sees_crashes_and_waits_for_replacements(control_plane, operator,
                                                                                     tiny_model):
    """The orchestrator's Kubernetes backend, with the trainer's own ServiceAccount (chart RBAC)."""
    import asyncio

    from rlfleet.kube.client import KubeClient
    from rlfleet.orchestrator.fleet.backend import DeathCause, EngineState
    from rlfleet.orchestrator.fleet.k8s_backend import KubernetesBackend, router_address

    cp = control_plane
    await asyncio.to_thread(apply, cp, fleet_manifest("rf-k", tiny_model, replicas=1))
    trainer_kubeconfig = await asyncio.to_thread(cp.service_account_kubeconfig, NS, "rlfleet-trainer")
    kube = await KubeClient.load(trainer_kubeconfig)
    backend = await KubernetesBackend.connect(kube, namespace=NS, fleet="rf-k")
    deaths = []
    try:
        await backend.start()
        backend.subscribe(deaths.append)
        first = await backend.wait_all_alive(timeout=ENGINE_START_S)
        assert [(e.slot, e.incarnation, e.state) for e in first] == [(0, 1, EngineState.ALIVE)]
        key = await asyncio.to_thread(fleet_api_key, cp, "rf-k", NS)
        assert http_json(first[0].url + "/model_info", api_key=key)["model_path"] == str(tiny_model)
        [first_uid] = [p["metadata"]["uid"] for p in engine_pods(cp, "rf-k", 0)]

        # Marked dead by the orchestrator -> the operator recreates the slot. The API server refuses the
        # first write of the mark (the trainer's Role may not patch fleet status for a moment): marking
        # does not fail (a sync with paused engines must go on), and the mark lands once it may.
        role = await asyncio.to_thread(get_json, cp, "role", "rlfleet-trainer", namespace=NS)
        assert role is not None
        role = {**role, "metadata": {k: v for k, v in role["metadata"].items() if k in ("name", "namespace")}}
        no_status_patch = {**role, "rules": [{**r, "verbs": [v for v in r["verbs"] if v != "patch"]}
                                             for r in role["rules"]]}
        await asyncio.to_thread(apply, cp, no_status_patch)
        can_patch = ("auth", "can-i", "patch", "rolloutfleets/status", "-n", NS,
                     f"--as=system:serviceaccount:{NS}:rlfleet-trainer")
        await asyncio.to_thread(wait_for, lambda: cp.kubectl(*can_patch, check=False).stdout.strip() == "no",
                                timeout=30, what="the trainer's Role without status patch")
        try:
            assert await backend.mark_dead(0, "3 probes timed out", cause=DeathCause.PROBE_FAILED, incarnation=1)
            assert backend.engines()[0].state is EngineState.DEAD and deaths[-1].cause is DeathCause.PROBE_FAILED
            assert not await backend.mark_dead(0, "again", incarnation=1)  # a stale report changes nothing
            await asyncio.sleep(3)
            status = await asyncio.to_thread(fleet_status, cp, "rf-k")
            assert not status.get("orchestrator", {}).get("engines"), "the mark was refused, yet it is there"
            assert [p["metadata"]["uid"] for p in engine_pods(cp, "rf-k", 0)] == [first_uid]
        finally:
            await asyncio.to_thread(apply, cp, role)
        second = await backend.wait_all_alive(timeout=ENGINE_START_S)
        assert [(e.slot, e.incarnation) for e in second] == [(0, 2)] and second[0].url != first[0].url
        status = await asyncio.to_thread(fleet_status, cp, "rf-k")
        assert status["restarts"] == 1 and status["engines"][0]["lastFailure"]["reason"] == "ProbeFailed"
        assert status["engines"][0]["lastFailure"]["message"] == "3 probes timed out"
        backend.record_weight_version(0, 2, "5")  # shown in the fleet status through the orchestrator's mark
        for _ in range(100):
            status = await asyncio.to_thread(fleet_status, cp, "rf-k")
            if status.get("weightVersion") == "5":
                break
            await asyncio.sleep(0.2)
        assert status.get("weightVersion") == "5" and status["engines"][0]["weightVersion"] == "5"

        # A crash is seen from the pod watch, without any probe.
        pgid = engine_pgid(second[0].url.split("//")[1].split(":")[0])
        killed = asyncio.get_running_loop().time()
        os.killpg(pgid, signal.SIGKILL)
        # Polled, bounded: the assertions below must also see a death that never comes.
        while len(deaths) < 2 and asyncio.get_running_loop().time() - killed < 30:  # noqa: ASYNC110 - see above
            await asyncio.sleep(0.05)
        detect_s = asyncio.get_running_loop().time() - killed
        assert len(deaths) == 2 and deaths[1].cause is DeathCause.EXITED and deaths[1].incarnation == 2
        assert "exit code 137" in deaths[1].reason
        assert detect_s < 25  # the node agent, the API server and the watch, on a loaded machine

        router = await router_address(kube, NS, "rf-k", 30000, fleet_uid=backend.fleet_uid)
        url = router.url if router is not None else None
        assert url is not None and http_json(url + "/get_server_info")["workers_count"] == 0
        print(f"\nfigures: crash seen by the backend {detect_s:.2f} s after SIGKILL")
    finally:
        await backend.stop()
        await kube.close()
        await asyncio.to_thread(delete_and_wait, cp, "rolloutfleet", "rf-k", "rlfleet.io/fleet=rf-k")


QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
QUICKSTART_STEPS, QUICKSTART_EVAL_INTERVAL, QUICKSTART_CHECKPOINT_INTERVAL = 10, 5, 2


def quickstart_on_cluster(*, steps: int, eval_interval: int, checkpoint_interval: int) -> dict:
    """examples/quickstart.yaml as `kubectl apply` takes it, shortened (fewer steps, denser eval), with
    checkpoints."""
    import yaml

    run = yaml.safe_load(QUICKSTART.read_text())
    run["metadata"]["namespace"] = NS
    spec = run["spec"]
    spec["trainer"]["steps"] = steps
    spec["rollout"]["health"]["startupTimeoutSeconds"] = ENGINE_START_S
    spec["eval"]["intervalSteps"] = eval_interval
    spec["checkpoint"] = {"intervalSteps": checkpoint_interval}
    return run


def complete_checkpoints(claim_dir: Path) -> list[int]:
    """Steps of the checkpoints on the run's claim whose marker is written (what a resume may use)."""
    return sorted(int(m.parent.name.removeprefix("step_")) for m in (claim_dir / "checkpoints").glob("step_*/COMPLETE"))


def run_status(cp, name: str) -> dict:
    return (get_json(cp, "trainingrun", name, namespace=NS) or {}).get("status", {})


def engine_model_path(pod: dict) -> str:
    """The model the pod's engine command names (its own pod name substituted, as the kubelet does)."""
    command = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")["command"]
    return command[command.index("--model-path") + 1].replace("$(POD_NAME)", pod["metadata"]["name"])


def serves_its_model(served: str, pod: dict) -> bool:
    """The engine serves what its pod started with, or a weight snapshot a sync loaded since (step_N).

    The node agent runs the engine on the claim's directory where the pod mounts it: a path under the
    mount is reported as the same path under the claim's directory (`.../quickstart-snapshots/...`)."""
    started = engine_model_path(pod)
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    for mount in engine.get("volumeMounts") or []:
        inside = mount["mountPath"].rstrip("/") + "/"
        if started.startswith(inside) and served.endswith("/quickstart-snapshots/" + started[len(inside):]):
            return True
    return served == started or re.fullmatch(r".*/quickstart-snapshots/step_\d+", served) is not None


def engine_answers(url: str, key: str) -> tuple[str, int]:
    """(model_path the engine serves to the fleet's key, HTTP status of the same call without a key)."""
    served = http_json(url + "/model_info", api_key=key)["model_path"]
    try:
        http_json(url + "/model_info")
        refused = 200
    except urllib.error.HTTPError as e:
        refused = e.code
    return served, refused


@pytest.fixture(scope="module")
def quickstart(control_plane, operator, node_agent) -> dict:
    """ONE `kubectl apply` of the quickstart, driven through its faults; the tests below assert their aspects.

    Three real SGLang engines (two rollout, one eval) run through the node agent. At step 2 the rollout
    engines are checked as a user would; rollout engine 1 is SIGKILLed, and the operator is restarted
    as soon as it has recorded the recreation. Once a checkpoint two steps after the kill is complete
    (so it holds the recovery) and the engines serve a later step, the trainer pod is deleted: the
    operator recreates it, and it resumes beside the running engines, bringing them back to the
    checkpoint's weights. Two steps into the resumed trainer the rollout router's pod is deleted.
    Everything the tests look at is gathered here (the run is deleted before they run, so no engine
    outlives this fixture).
    """
    cp = control_plane
    fleet = "quickstart-rollout"
    steps, interval = QUICKSTART_STEPS, QUICKSTART_EVAL_INTERVAL
    seen: dict = {}
    started = time.monotonic()
    apply(cp, quickstart_on_cluster(steps=steps, eval_interval=interval,
                                    checkpoint_interval=QUICKSTART_CHECKPOINT_INTERVAL))
    claim_dir = node_agent.log_path.parent / "claims" / NS / "quickstart-snapshots"

    def context() -> str:
        return "\n".join([json.dumps(run_status(cp, "quickstart"))[-1500:], diagnostics(cp, operator, node_agent),
                          pod_log(node_agent, NS, "quickstart-trainer", "trainer")[-4000:]])

    try:
        # Step 2: the run is Running; its rollout fleet's engines serve, each on its own address.
        seen["at_step_2"] = wait_for(lambda: (s := run_status(cp, "quickstart")).get("step", 0) >= 2 and s,
                                     timeout=ENGINE_START_S + 600, interval=1, what="the run to reach step 2",
                                     context=context)
        seen["running_s"] = time.monotonic() - started
        seen["row_running"] = cp.kubectl("get", "tr", "quickstart", "-n", NS).stdout.split("\n")[1].split()
        seen["fleet_ready"] = wait_for(lambda: (s := fleet_status(cp, fleet)).get("readyReplicas") == 2 and s,
                                       timeout=ENGINE_START_S, interval=1, what="2 ready rollout engines",
                                       context=context)
        seen["key"] = key = fleet_api_key(cp, fleet, NS)
        pods = {int(p["metadata"]["labels"]["rlfleet.io/slot"]): p for p in engine_pods(cp, fleet)}
        seen["pods_ready"] = pods
        seen["answers_ready"] = {e["slot"]: engine_answers(e["url"], key) for e in seen["fleet_ready"]["engines"]}
        seen["fleet_table"] = cp.kubectl("get", "rf", fleet, "-n", NS).stdout
        seen["router_pod"] = wait_for(
            lambda: [p for p in (get_json(cp, "pods", "-l", f"app.kubernetes.io/component=router,rlfleet.io/fleet="
                                          f"{fleet}", namespace=NS) or {}).get("items", [])
                     if p["status"].get("phase") == "Running"], timeout=120, what="the router pod")[0]

        # Crash rollout engine 1: every process of its group dies at once. As soon as the operator has
        # recorded the recreation, restart the operator.
        seen["victim"] = victim = pods[1]
        pgid = engine_pgid(victim["status"]["podIP"])
        assert pgid is not None, "engine process not found"
        seen["killed_at_step"] = run_status(cp, "quickstart")["step"]
        killed_at = time.monotonic()
        os.killpg(pgid, signal.SIGKILL)
        wait_for(lambda: (fleet_status(cp, fleet).get("restarts") or 0) >= 1, timeout=120, interval=0.5,
                 what="the recreation to be recorded", context=operator.tail)
        operator.stop()
        seen["pods_per_slot"] = per_slot = [len(engine_pods(cp, fleet, 1))]
        operator.start()

        def recovered():
            per_slot.append(len(engine_pods(cp, fleet, 1)))
            s = fleet_status(cp, fleet)
            return s.get("readyReplicas") == 2 and s
        seen["fleet_recovered"] = wait_for(recovered, timeout=ENGINE_START_S, interval=1,
                                           what="slot 1 to serve again", context=context)
        seen["recovery_s"] = time.monotonic() - killed_at
        seen["replacement"] = replacement = engine_pods(cp, fleet, 1)[0]
        slot1 = next(e for e in seen["fleet_recovered"]["engines"] if e["slot"] == 1)
        seen["answers_recovered"] = engine_answers(slot1["url"], key)
        seen["fleet_events_recovered"] = {e["reason"] for e in events_of(cp, fleet)}
        seen["operator_metrics"] = operator.metrics()
        assert replacement["metadata"]["uid"] != victim["metadata"]["uid"]

        # A checkpoint that holds the recovery is complete: the trainer pod goes. The operator recreates it;
        # the new one resumes from the newest complete checkpoint beside the engines, which keep running.
        seen["checkpoint_before_delete"] = wait_for(
            lambda: (done := complete_checkpoints(claim_dir)) and done[-1] >= seen["killed_at_step"] + 2
            and run_status(cp, "quickstart").get("step", 0) > done[-1] and done[-1], timeout=900, interval=0.5,
            what="a checkpoint two steps after the kill, and a step after it", context=context)
        seen["trainer_deleted"] = get_json(cp, "pod", "quickstart-trainer", namespace=NS)
        seen["engine_uids_before"] = sorted(p["metadata"]["uid"] for p in engine_pods(cp, fleet))
        seen["trainer_deleted_at_step"] = run_status(cp, "quickstart")["step"]
        deleted_at = time.monotonic()
        cp.kubectl("delete", "pod", "quickstart-trainer", "-n", NS, "--wait=false")
        phases: list = []

        def new_trainer_log() -> str:
            pod = get_json(cp, "pod", "quickstart-trainer", namespace=NS)
            if not pod or pod["metadata"]["uid"] == seen["trainer_deleted"]["metadata"]["uid"]:
                return ""
            return cp.kubectl("logs", "quickstart-trainer", "-n", NS, check=False).stdout

        def resumed() -> int | None:
            phases.append(run_status(cp, "quickstart").get("phase"))
            found = re.search(r"resuming from checkpoint step (\d+)", new_trainer_log())
            return int(found.group(1)) if found else None
        seen["resumed_step"] = resumed_step = wait_for(resumed, timeout=600, interval=1,
                                                       what="the recreated trainer to resume", context=context)
        seen["resume_s"] = time.monotonic() - deleted_at
        wait_for(lambda: phases.append(run_status(cp, "quickstart").get("phase"))
                 or f"step {resumed_step + 2}/{steps}" in new_trainer_log(), timeout=900, interval=0.2,
                 what="two steps of the recreated trainer", context=context)
        seen["phases_while_restarting"] = phases
        seen["trainer_recreated"] = get_json(cp, "pod", "quickstart-trainer", namespace=NS)
        seen["engine_uids_after"] = sorted(p["metadata"]["uid"] for p in engine_pods(cp, fleet))

        # Then the rollout router's pod goes: the Deployment replaces it (new address); the trainer follows.
        # The trainer is held meanwhile, with steps left (a step takes a fraction of a second): it finds
        # the old address dead and the new pod there.
        routers = f"app.kubernetes.io/component=router,rlfleet.io/fleet={fleet}"
        with pod_held("quickstart-trainer", NS):
            seen["router_deleted_at_step"] = run_status(cp, "quickstart")["step"]
            router = get_json(cp, "pods", "-l", routers, namespace=NS)["items"][0]
            seen["router_deleted"] = router
            cp.kubectl("delete", "pod", router["metadata"]["name"], "-n", NS, "--wait=false")
            wait_for(lambda: [p for p in (get_json(cp, "pods", "-l", routers, namespace=NS) or {}).get("items", [])
                              if p["metadata"]["uid"] != router["metadata"]["uid"]
                              and p["status"].get("phase") == "Running"], timeout=120, interval=0.5,
                     what="the router's replacement pod", context=context)

        seen["final"] = wait_for(lambda: (s := run_status(cp, "quickstart")).get("phase") in ("Succeeded", "Failed")
                                 and s, timeout=1800, interval=2, what="the run to finish", context=context)
        seen["total_s"] = time.monotonic() - started
        seen["row_final"] = cp.kubectl("get", "tr", "quickstart", "-n", NS).stdout.split("\n")[1].split()
        # The run summary, written by the trainer on the run's snapshot volume.
        summary_file = claim_dir / "quickstart-summary.json"
        seen["summary"] = json.loads(summary_file.read_text()) if summary_file.exists() else None
        seen["trainer_log"] = cp.kubectl("logs", "quickstart-trainer", "-n", NS).stdout  # what a user would read
        seen["fleet_final"] = fleet_status(cp, fleet)
        seen["fleet_events"] = {e["reason"] for e in events_of(cp, fleet)}
        seen["run_events"] = {e["reason"] for e in events_of(cp, "quickstart")}
        print(f"\nfigures: step 2 reached {seen['running_s']:.0f} s after apply, Succeeded after "
              f"{seen['total_s']:.0f} s; engine killed at step {seen['killed_at_step']} and serving again after "
              f"{seen['recovery_s']:.0f} s (operator restarted in between); trainer pod deleted at step "
              f"{seen['trainer_deleted_at_step']}, resumed from checkpoint step {seen['resumed_step']} "
              f"{seen['resume_s']:.0f} s later; router pod deleted at step {seen['router_deleted_at_step']}")
    finally:
        cp.kubectl("delete", "trainingrun", "quickstart", "-n", NS, "--wait=false", check=False)
        wait_for(lambda: not (get_json(cp, "pods", "-l", "rlfleet.io/run=quickstart", namespace=NS) or {})
                 .get("items"), timeout=180, what="the run's pods to be gone", context=lambda: diagnostics(cp))
    return seen


@pytest.mark.engines
@pytest.mark.timeout(2700)
def test_fleet_ready_recovers_a_killed_engine_across_an_operator_restart(quickstart):
    """The quickstart's rollout fleet: ready engines on their own addresses, answering only the fleet's
    key; a SIGKILLed engine recreated once (one pod per slot) across a restart of the operator."""
    seen = quickstart
    ready = seen["fleet_ready"]
    engines = {e["slot"]: e for e in ready["engines"]}
    assert [engines[s]["state"] for s in (0, 1)] == ["Ready", "Ready"]
    for slot, (served, refused) in seen["answers_ready"].items():  # the real engine, to the fleet's key only
        assert serves_its_model(served, seen["pods_ready"][slot]), (slot, served)
        assert refused == 401, slot
    assert engines[0]["url"] != engines[1]["url"]
    assert condition(ready, "Ready")["status"] == "True"
    table = seen["fleet_table"]
    assert table.split("\n")[0].split()[:5] == ["NAME", "DESIRED", "READY", "WEIGHTS", "RESTARTS"]
    router_ip = seen["router_pod"]["status"]["podIP"]
    assert router_ip not in [e["url"].split("//")[1].split(":")[0] for e in engines.values()]

    assert max(seen["pods_per_slot"]) <= 1, f"two pods in one slot: {seen['pods_per_slot']}"
    new, old = seen["replacement"], seen["victim"]
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["metadata"]["annotations"]["rlfleet.io/restarts"] == "1"
    status = seen["fleet_recovered"]
    slot1 = next(e for e in status["engines"] if e["slot"] == 1)
    assert slot1["restarts"] == 1 and status["restarts"] == 1, status  # counted once, across the restart
    # Whoever sees the SIGKILL first names it: the node (the container's exit) or the trainer's
    # orchestrator (its calls refused, a dead mark); either way it is the killed pod's failure.
    failure = slot1["lastFailure"]
    assert failure["reason"] in ("Crashed", "Unreachable"), failure
    assert failure["reason"] != "Crashed" or failure["exitCode"] == 137, failure
    served, refused = seen["answers_recovered"]
    assert serves_its_model(served, new) and refused == 401, served
    assert {"EngineDead", "RecreatingEngine"} <= seen["fleet_events_recovered"], seen["fleet_events_recovered"]
    assert 'rlfleet_operator_reconciles_total{kind="RolloutFleet",outcome="ok"}' in seen["operator_metrics"]


@pytest.mark.engines
@pytest.mark.timeout(2700)
def test_quickstart_on_the_cluster_recovers_a_killed_engine_and_succeeds(quickstart):
    """`kubectl apply` of the quickstart: the trainer pod drives the operator's fleets to Succeeded.

    The killed rollout engine must be recreated before the next weight sync and serve that version;
    the trainer must follow the rollout router's replacement pod.
    """
    seen = quickstart
    steps, interval = QUICKSTART_STEPS, QUICKSTART_EVAL_INTERVAL
    status = seen["at_step_2"]
    assert status["phase"] == "Running" and status["weightVersion"] == str(status["step"])
    assert seen["row_running"][:2] == ["quickstart", "Running"], seen["row_running"]

    final = seen["final"]
    assert final["phase"] == "Succeeded", json.dumps(final)[-3000:]
    assert final["step"] == steps and final["weightVersion"] == str(steps)
    assert final["lastEval"]["step"] == steps and final["lastEval"]["weightVersion"] == str(steps)
    assert set(final["lastEval"]["scores"]) == {"rotate"}
    assert seen["row_final"][:4] == ["quickstart", "Succeeded", str(steps), str(steps)], seen["row_final"]

    summary = seen["summary"]
    assert summary is not None, "no run summary on the run's snapshot volume"
    assert summary["steps_completed"] == steps and summary["failure"] is None
    recovered = {int(step): slots for step, slots in summary["recovered_slots_per_step"].items()}
    assert recovered, "no step recovered the killed engine"
    first, killed_at_step = min(recovered), seen["killed_at_step"]
    # Recreated before the next weight sync after the kill (the one after, if the kill hit a sync in
    # flight), and serving that sync's version from then on.
    assert recovered[first] == [1] and killed_at_step < first <= killed_at_step + 2, (killed_at_step, recovered)
    for step in range(first, steps + 1):
        assert summary["engine_versions_per_step"][str(step)] == {"0": str(step), "1": str(step)}, step
    assert summary["engines_marked_dead"] >= 1 and summary["engines_recreated"] == 1

    # Eval on the operator's EvalFleet, at every interval and the final step, from one version each.
    points = {p["step"]: p for p in summary["eval"]}
    assert sorted(points) == list(range(0, steps + 1, interval))
    for step, point in points.items():
        assert point["skipped"] is None and point["posture"] == "fleet", point
        assert point["weight_version"] == str(step) and point["mixed_version_ratio"] == 0
    assert final["lastEval"]["scores"]["rotate"] == pytest.approx(points[steps]["scores"]["rotate"], abs=1e-3)

    assert seen["router_deleted_at_step"] < steps, seen["router_deleted_at_step"]
    router_ip = seen["router_deleted"]["status"]["podIP"]
    trainer_log = seen["trainer_log"]
    assert f"router moved {router_ip}" in trainer_log.replace("http://", ""), trainer_log[-3000:]

    assert seen["fleet_final"]["restarts"] == 1
    assert {"EngineDead", "RecreatingEngine"} <= seen["fleet_events"], seen["fleet_events"]


@pytest.mark.engines
@pytest.mark.timeout(2700)
def test_a_deleted_trainer_pod_is_recreated_resumes_beside_the_running_engines_and_succeeds(quickstart):
    """The quickstart's trainer pod deleted after a checkpoint: recreated by the operator (within
    spec.trainer.maxRestarts), resumed from the newest complete checkpoint, every step once."""
    seen = quickstart
    steps = QUICKSTART_STEPS
    old, new = seen["trainer_deleted"], seen["trainer_recreated"]
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["metadata"]["annotations"]["rlfleet.io/restarts"] == "1"
    assert "--resume" in new["spec"]["containers"][0]["command"]
    assert "Failed" not in seen["phases_while_restarting"], seen["phases_while_restarting"]
    assert seen["engine_uids_after"] == seen["engine_uids_before"]  # the engines kept running
    assert seen["checkpoint_before_delete"] <= seen["resumed_step"] < steps

    final = seen["final"]
    assert final["phase"] == "Succeeded" and final["step"] == steps, json.dumps(final)[-3000:]
    trainer = final["trainer"]
    assert trainer["restarts"] == 1 and trainer["failures"] == 1, trainer
    assert trainer["lastFailure"]["reason"] in ("TrainerLost", "TrainerFailed"), trainer
    assert {"TrainerDead", "RecreatingTrainer", "Succeeded"} <= seen["run_events"], seen["run_events"]

    summary = seen["summary"]
    assert summary["resumed_from"] == [seen["resumed_step"]]
    assert summary["steps_completed"] == steps  # each step once: the ones after the checkpoint trained again
    assert sorted(int(k) for k in summary["loss_per_step"]) == list(range(1, steps + 1))
    assert f"resuming from checkpoint step {seen['resumed_step']}" in seen["trainer_log"]
    if seen["trainer_deleted_at_step"] > seen["resumed_step"]:  # the engines served later weights: synced back
        assert f"loading the launch weights v{seen['resumed_step']} into them" in seen["trainer_log"]


@pytest.mark.timeout(600)
def test_a_trainer_that_always_crashes_ends_failed_after_max_restarts_with_its_log_line(
        control_plane, operator, node_agent):
    """A trainer pod that cannot start (it finds no usable kubeconfig) is recreated once (maxRestarts 1),
    then the run fails with the trainer's own error line. Its engine never starts (no node fits it)."""
    cp = control_plane
    run = {
        "apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
        "metadata": {"name": "tr-crash", "namespace": NS},
        "spec": {"modelPath": "tiny://llama",
                 "trainer": {"gpus": 0, "steps": 2, "maxRestarts": 1,
                             "env": [{"name": "KUBECONFIG", "value": "/nonexistent/kubeconfig"}]},
                 "rollout": {"replicas": 1,
                             "engine": {"device": "cpu", "nodeSelector": {"rlfleet.io/test": "nowhere"}}},
                 "weightSync": {"snapshotVolume": {"size": "1Gi"}}},
    }
    started = time.monotonic()
    apply(cp, run)
    try:
        status = wait_for(lambda: (s := run_status(cp, "tr-crash")).get("phase") == "Failed" and s, timeout=300,
                          interval=1, what="the run to fail",
                          context=lambda: json.dumps(run_status(cp, "tr-crash"))[-2000:] + operator.tail())
        elapsed = time.monotonic() - started
        failed = condition(status, "Failed")
        assert failed["reason"] == "TrainerFailed", failed
        assert "Invalid kube-config file" in failed["message"], failed  # the trainer's own last log line
        assert "exit code 1" in failed["message"] and "maxRestarts 1" in failed["message"], failed
        assert status["trainer"]["restarts"] == 1 and status["trainer"]["failures"] == 2, status["trainer"]
        pod = get_json(cp, "pod", "tr-crash-trainer", namespace=NS)  # the last one, kept for diagnosis
        assert pod["status"]["phase"] == "Failed" and pod["metadata"]["annotations"]["rlfleet.io/restarts"] == "1"
        reasons = [e["reason"] for e in events_of(cp, "tr-crash")]
        assert {"TrainerDead", "RecreatingTrainer", "TrainerFailed"} <= set(reasons), reasons
        time.sleep(3)
        assert get_json(cp, "pod", "tr-crash-trainer", namespace=NS)["metadata"]["uid"] == pod["metadata"]["uid"]
        print(f"\nfigures: the crashing trainer recreated once and the run Failed {elapsed:.0f} s after creation")
    finally:
        cp.kubectl("delete", "trainingrun", "tr-crash", "-n", NS, "--wait=false", check=False)
        wait_for(lambda: not (get_json(cp, "pods", "-l", "rlfleet.io/run=tr-crash", namespace=NS) or {})
                 .get("items"), timeout=180, what="the run's pods to be gone", context=lambda: diagnostics(cp))


def layout_run(name: str, tensor_parallel: int) -> dict:
    """A megatron run of `tensor_parallel` CPU ranks on the tiny Llama (4 heads, 2 kv heads); its engine
    never starts (no node fits it): what is asserted happens before any rollout."""
    return {
        "apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"modelPath": "tiny://llama",
                 "trainer": {"backend": "megatron", "gpus": 0, "tensorParallelSize": tensor_parallel, "steps": 2,
                             "maxRestarts": 0},
                 "rollout": {"replicas": 1,
                             "engine": {"device": "cpu", "nodeSelector": {"rlfleet.io/test": "nowhere"}}},
                 "weightSync": {"snapshotVolume": {"size": "1Gi"}}},
    }


@pytest.mark.timeout(600)
def test_a_layout_the_model_cannot_take_fails_the_run_before_any_fleet_exists(control_plane, operator, node_agent):
    """Only the trainer pod reads the model. Tensor parallel 3 does not divide the tiny Llama's 4 heads:
    the pod refuses it, naming the field and the numbers, and the run fails with no RolloutFleet and no
    engine pod ever made. Tensor parallel 2 fits: the pod records its check on the run, and only then does
    the operator create the run's fleet."""
    cp = control_plane
    apply(cp, layout_run("tr-tp3", 3))
    apply(cp, layout_run("tr-tp2", 2))
    try:
        status = wait_for(lambda: (s := run_status(cp, "tr-tp3")).get("phase") == "Failed" and s, timeout=300,
                          interval=1, what="the tensor-parallel-3 run to fail",
                          context=lambda: json.dumps(run_status(cp, "tr-tp3"))[-2000:] + operator.tail())
        failed = condition(status, "Failed")
        assert failed["reason"] == "TrainerSetupFailed", failed
        assert "spec.trainer.tensorParallelSize 3 does not divide the model's num_attention_heads 4" in \
            failed["message"], failed
        assert get_json(cp, "rolloutfleet", "tr-tp3-rollout", namespace=NS) is None, "a fleet was created"
        assert not (get_json(cp, "pods", "-l", "rlfleet.io/fleet=tr-tp3-rollout", namespace=NS) or {}).get("items")
        assert not (status.get("trainer") or {}).get("layoutChecked"), status["trainer"]

        fleet = wait_for(lambda: get_json(cp, "rolloutfleet", "tr-tp2-rollout", namespace=NS), timeout=300,
                         interval=1, what="the tensor-parallel-2 run's fleet",
                         context=lambda: json.dumps(run_status(cp, "tr-tp2"))[-2000:] + operator.tail())
        checked = run_status(cp, "tr-tp2")
        assert checked["trainer"]["layoutChecked"] is True, checked
        assert fleet["metadata"]["ownerReferences"][0]["name"] == "tr-tp2"
        assert get_json(cp, "secret", "tr-tp2-rollout-api-key", namespace=NS) is not None
    finally:
        for name in ("tr-tp3", "tr-tp2"):
            cp.kubectl("delete", "trainingrun", name, "-n", NS, "--wait=false", check=False)
        for name in ("tr-tp3", "tr-tp2"):
            wait_for(lambda n=name: not (get_json(cp, "pods", "-l", f"rlfleet.io/run={n}", namespace=NS) or {})
                     .get("items"), timeout=180, what=f"{name}'s pods to be gone", context=lambda: diagnostics(cp))


@pytest.mark.timeout(300)
def test_scale_subresource_scales_a_fleet_down(control_plane, operator, node_agent):
    """`kubectl scale` of a RolloutFleet: the slot above the new count goes (pods that never start suffice)."""
    cp = control_plane
    fleet = fleet_manifest("rf-s", Path("/models/none"), replicas=2)
    fleet["spec"]["engine"]["nodeSelector"] = {"rlfleet.io/test": "nowhere"}
    apply(cp, fleet)
    try:
        wait_for(lambda: len(engine_pods(cp, "rf-s")) == 2 and fleet_status(cp, "rf-s").get("replicas") == 2,
                 timeout=60, what="2 engine pods")
        cp.kubectl("scale", "rolloutfleet/rf-s", "-n", NS, "--replicas=1")
        wait_for(lambda: not engine_pods(cp, "rf-s", 1) and fleet_status(cp, "rf-s").get("replicas") == 1,
                 timeout=120, what="slot 1 to be scaled away", context=lambda: diagnostics(cp, node_agent, operator))
        assert len(engine_pods(cp, "rf-s", 0)) == 1
    finally:
        delete_and_wait(cp, "rolloutfleet", "rf-s", "rlfleet.io/fleet=rf-s", node_agent, operator)


def routed_to(cp, fleet: str, key: str) -> list[str]:
    """The worker URLs the fleet's router routes to (its Running router pod's GET /workers)."""
    pods = (get_json(cp, "pods", "-l", f"app.kubernetes.io/component=router,rlfleet.io/fleet={fleet}", namespace=NS)
            or {}).get("items", [])
    running = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
    if not running:
        return []
    port = running[0]["spec"]["containers"][0]["ports"][0]["containerPort"]
    try:
        workers = http_json(f"http://{running[0]['status']['podIP']}:{port}/workers", api_key=key, timeout=10)
    except (OSError, ValueError):
        return []
    return sorted(w["url"] for w in workers.get("workers", []))


def generate_through_router(cp, fleet: str, key: str) -> dict:
    (router,) = [p for p in get_json(cp, "pods", "-l", f"app.kubernetes.io/component=router,rlfleet.io/fleet={fleet}",
                                     namespace=NS)["items"] if p["status"].get("phase") == "Running"]
    port = router["spec"]["containers"][0]["ports"][0]["containerPort"]
    body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).encode()
    request = urllib.request.Request(f"http://{router['status']['podIP']}:{port}/generate", data=body,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.engines
@pytest.mark.timeout(1800)
def test_a_fleet_of_no_run_takes_an_edit_by_replacing_its_engine_and_recreates_a_hung_one(
        control_plane, operator, node_agent, tiny_model):
    """A fleet of no run, its one engine serving, and its router routing to it (the engine follower in the
    router pod: no trainer registers them). An edit of its engine and health specs replaces the pod with
    one built from them, which serves, with no restart counted, and the router follows. That engine then
    hangs (SIGSTOP): the liveness probe built from the health spec ends it, the operator recreates the
    slot (often on the same IP) and the router routes to the new engine only."""
    cp = control_plane
    apply(cp, fleet_manifest("rf-u", tiny_model, replicas=1))
    try:
        def serving() -> bool:
            status = fleet_status(cp, "rf-u")
            return status.get("readyReplicas") == 1 and condition(status, "Progressing").get("status") == "False"

        def uids() -> list[str]:
            return [p["metadata"]["uid"] for p in engine_pods(cp, "rf-u")]

        def routed_to_only(pod: dict) -> list[str]:
            url = fleet_status(cp, "rf-u")["engines"][0]["url"]
            assert pod["status"]["podIP"] in url
            return routed_to(cp, "rf-u", key) if routed_to(cp, "rf-u", key) == [url] else []

        wait_for(serving, timeout=ENGINE_START_S, what="rf-u's engine to serve",
                 context=lambda: diagnostics(cp, node_agent, operator))
        (before,) = engine_pods(cp, "rf-u")
        key = fleet_api_key(cp, "rf-u", NS)
        wait_for(lambda: routed_to_only(before), timeout=60, what="the router to route to the engine",
                 context=lambda: diagnostics(cp, node_agent, operator))

        def containers_ready() -> dict[str, bool]:
            (router,) = get_json(cp, "pods", "-l", "app.kubernetes.io/component=router,rlfleet.io/fleet=rf-u",
                                 namespace=NS)["items"]
            return {s["name"]: s["ready"] for s in router["status"].get("containerStatuses", [])}

        # Both containers Ready: the router, and the follower keeping its workers (its own probe).
        wait_for(lambda: containers_ready() == {"router": True, "engine-follower": True}, timeout=30,
                 what="the router pod's two containers to be Ready", context=containers_ready)
        assert generate_through_router(cp, "rf-u", key)["meta_info"]["completion_tokens"] == 3
        health = {"intervalSeconds": 2, "timeoutSeconds": 3, "failureThreshold": 2, "startupTimeoutSeconds": 600}
        cp.kubectl("patch", "rolloutfleet", "rf-u", "-n", NS, "--type", "merge", "-p", json.dumps(
            {"spec": {"engine": {"env": [{"name": "E2E_EDIT", "value": "2"}]}, "health": health}}))
        wait_for(lambda: any(e["reason"] == "UpdatingEngine" for e in events_of(cp, "rf-u")), timeout=60,
                 what="the UpdatingEngine Event", context=lambda: diagnostics(cp, operator))
        wait_for(lambda: uids() not in ([], [before["metadata"]["uid"]]) and serving(), timeout=ENGINE_START_S,
                 what="the replacement to serve", context=lambda: diagnostics(cp, node_agent, operator))
        (after,) = engine_pods(cp, "rf-u")
        container = after["spec"]["containers"][0]
        assert {"name": "E2E_EDIT", "value": "2"} in container["env"]
        assert container["livenessProbe"]["periodSeconds"] == 2 and container["livenessProbe"]["failureThreshold"] == 2
        digest = "rlfleet.io/engine-spec"
        assert after["metadata"]["annotations"][digest] != before["metadata"]["annotations"][digest]
        status = fleet_status(cp, "rf-u")
        assert status["restarts"] == 0 and status["engines"][0]["restarts"] == 0
        assert condition(status, "Degraded")["status"] == "False"
        assert http_json(status["engines"][0]["url"] + "/model_info", api_key=key)["model_path"] == str(tiny_model)
        wait_for(lambda: routed_to_only(after), timeout=60, what="the router to route to the replacement only",
                 context=lambda: diagnostics(cp, node_agent, operator))
        (event,) = [e for e in events_of(cp, "rf-u") if e["reason"] == "UpdatingEngine"]
        assert "replacing slot 0 (rf-u-engine-0, Ready)" in event["message"]

        # Hung: it still accepts connections but answers nothing. No orchestrator watches this fleet.
        os.killpg(engine_pgid(after["status"]["podIP"]), signal.SIGSTOP)
        hung = time.monotonic()
        wait_for(lambda: fleet_status(cp, "rf-u").get("restarts") == 1, timeout=180,
                 what="the hung engine's slot to be recreated", context=lambda: diagnostics(cp, node_agent, operator))
        recreated_s = time.monotonic() - hung
        wait_for(lambda: after["metadata"]["uid"] not in uids() and serving(), timeout=ENGINE_START_S,
                 what="the recreated engine to serve", context=lambda: diagnostics(cp, node_agent, operator))
        status = fleet_status(cp, "rf-u")
        assert status["engines"][0]["restarts"] == 1 and status["engines"][0]["lastFailure"]["exitCode"] == 137
        (recreated,) = engine_pods(cp, "rf-u")
        wait_for(lambda: routed_to_only(recreated), timeout=60, what="the router to route to the new engine only",
                 context=lambda: diagnostics(cp, node_agent, operator))
        assert generate_through_router(cp, "rf-u", key)["meta_info"]["completion_tokens"] == 3
        print(f"\nfigures: hung engine recreated {recreated_s:.1f} s after SIGSTOP "
              "(liveness 2 x 2 s, 30 s grace, then the SIGKILL)")
    finally:
        delete_and_wait(cp, "rolloutfleet", "rf-u", "rlfleet.io/fleet=rf-u", node_agent, operator)


SCALED_STEPS = 20


def scaled_run() -> dict:
    """The quickstart with one rollout engine, broadcast weight sync (every sync's checksums compared), no eval."""
    run = quickstart_on_cluster(steps=SCALED_STEPS, eval_interval=1, checkpoint_interval=1)
    run["metadata"]["name"] = "scaled"
    spec = run["spec"]
    del spec["eval"], spec["checkpoint"]
    spec["trainer"].update(promptsPerStep=8, samplesPerPrompt=8)
    spec["rollout"].update(replicas=1, minReadyEngines=1)
    spec["rollout"]["recovery"]["waitAllAliveTimeoutSeconds"] = ENGINE_START_S  # a sync waits for minReadyEngines
    spec["weightSync"] = {"mode": "broadcast", "verifyEvery": 1, "transferTimeoutSeconds": 120}
    return run


@pytest.mark.engines
@pytest.mark.timeout(2400)
def test_a_runs_rollout_fleet_scaled_up_and_down_while_it_trains(control_plane, operator, node_agent):
    """`kubectl patch` of a running run's spec.rollout, 1 -> 2 engines (minReadyEngines 2, so the next sync
    waits for the new one: without it training goes on and the engine joins at the first sync after it is
    Ready, which this run could end before), then `kubectl scale tr --replicas=1`. The operator scales the
    run's RolloutFleet; the trainer's orchestrator follows: the sync rebuilds the update group over both
    engines and broadcasts the current weights into it (checksums compared) before the router sends the new
    one work; the engine scaled away leaves the router at once, its end no death, and the group is rebuilt
    over the one left. The run goes on to Succeeded, every step on every engine it had."""
    cp = control_plane
    fleet = "scaled-rollout"
    run = scaled_run()
    claim_dir = node_agent.log_path.parent / "claims" / NS / "scaled-snapshots"
    apply(cp, run)

    def context() -> str:
        return "\n".join([json.dumps(run_status(cp, "scaled"))[-1500:], diagnostics(cp, operator, node_agent),
                          pod_log(node_agent, NS, "scaled-trainer", "trainer")[-4000:]])

    def scale(replicas: int) -> int:
        step = run_status(cp, "scaled").get("step", 0)
        cp.kubectl("patch", "trainingrun", "scaled", "-n", NS, "--type", "merge",
                   "-p", json.dumps({"spec": {"rollout": {"replicas": replicas, "minReadyEngines": replicas}}}))
        return step

    def engine_urls() -> list[str]:
        return sorted(e["url"] for e in fleet_status(cp, fleet).get("engines", []) if e.get("url"))

    try:
        wait_for(lambda: run_status(cp, "scaled").get("step", 0) >= 1, timeout=ENGINE_START_S + 600, interval=1,
                 what="the run's first step", context=context)
        key = fleet_api_key(cp, fleet, NS)
        (first,) = engine_urls()
        up_at = scale(2)
        wait_for(lambda: get_json(cp, "rolloutfleet", fleet, namespace=NS)["spec"]["replicas"] == 2, timeout=60,
                 what="the operator to scale the run's fleet", context=context)
        # In the router once the trainer has given it the current weights (a sync after it turned Ready).
        both = wait_for(lambda: len(urls := engine_urls()) == 2 and routed_to(cp, fleet, key) == urls and urls,
                        timeout=ENGINE_START_S, interval=1, what="both engines in the router", context=context)
        joined_at = run_status(cp, "scaled")["step"]
        (second,) = set(both) - {first}
        wait_for(lambda: run_status(cp, "scaled").get("step", 0) >= joined_at + 1, timeout=300, interval=0.5,
                 what="a step with both engines", context=context)
        # The run's scale subresource is its rollout fleet's: what HPA and `kubectl scale` read and set.
        def scale_of_run() -> dict:
            return json.loads(cp.kubectl("get", "trainingrun", "scaled", "-n", NS, "--subresource=scale", "-o",
                                         "json").stdout)
        selector = f"app.kubernetes.io/component=engine,rlfleet.io/fleet={fleet}"
        wait_for(lambda: scale_of_run()["status"] == {"replicas": 2, "selector": selector}, timeout=60,
                 what="the run's scale status", context=lambda: json.dumps(scale_of_run()))
        cp.kubectl("patch", "trainingrun", "scaled", "-n", NS, "--type", "merge",
                   "-p", json.dumps({"spec": {"rollout": {"minReadyEngines": 1}}}))
        down_at = run_status(cp, "scaled").get("step", 0)
        cp.kubectl("scale", "trainingrun", "scaled", "-n", NS, "--replicas=1")
        wait_for(lambda: routed_to(cp, fleet, key) == [first] and not engine_pods(cp, fleet, 1), timeout=120,
                 interval=0.5, what="the engine scaled away to leave the router and its pod to go", context=context)
        status = fleet_status(cp, fleet)
        assert status["restarts"] == 0 and [e["slot"] for e in status["engines"]] == [0], status
        final = wait_for(lambda: (s := run_status(cp, "scaled")).get("phase") in ("Succeeded", "Failed") and s,
                         timeout=900, interval=1, what="the run to finish", context=context)
        assert final["phase"] == "Succeeded" and final["step"] == SCALED_STEPS, context()
        assert final["totalEngines"] == 1, final

        summary = json.loads((claim_dir / "scaled-summary.json").read_text())
        versions, syncs = summary["engine_versions_per_step"], summary["weight_sync_per_step"]
        slots_per_step = {int(step): sorted(v) for step, v in versions.items()}
        # The trainer saw each resize during a step (the step in progress: its sync may have come before or
        # after); every step before the scale-up ran on one engine, every step after the scale-down on one.
        resized = [e for e in summary["events"] if e["kind"] == "fleet_resized"]
        assert [e["detail"] for e in resized] == ["1 -> 2 engines, minReadyEngines 2",
                                                  "2 -> 1 engines, minReadyEngines 1"], resized
        up_step, down_step = resized[0]["step"], resized[1]["step"]
        assert up_at <= up_step and down_at <= down_step < SCALED_STEPS, (up_at, up_step, down_at, down_step)
        two = [step for step, slots in slots_per_step.items() if slots == ["0", "1"]]
        after = [step for step in slots_per_step if step > down_step]
        assert two and up_step <= min(two) and max(two) <= down_step, (up_step, down_step, slots_per_step)
        assert all(slots_per_step[step] == ["0"] for step in slots_per_step if step < up_step), slots_per_step
        assert all(slots_per_step[step] == ["0", "1"] for step in range(min(two), down_step)), slots_per_step
        assert after and all(slots_per_step[step] == ["0"] for step in after), slots_per_step
        for step in range(1, SCALED_STEPS + 1):
            sync = syncs[str(step)]
            engines = len(slots_per_step[step])
            assert versions[str(step)] == {slot: str(step) for slot in slots_per_step[step]}, (step, versions)
            assert sync["mode"] == "broadcast" and sync["fallback"] is None, (step, sync)
            assert sync["checksums"] == {"match": engines}, (step, sync)
        # The group is rebuilt for each change of its members: the first step over two engines, the first
        # over one again.
        one_again = min(step for step in slots_per_step if step > max(two))
        assert "group" in syncs[str(min(two))]["phases"] and "group" in syncs[str(one_again)]["phases"], syncs
        assert summary["engines_marked_dead"] == 0 and summary["recovered_slots_per_step"] == {}, summary
        trainer_log = pod_log(node_agent, NS, "scaled-trainer", "trainer")
        assert "rollout fleet scaled from 1 to 2 engines" in trainer_log, trainer_log[-3000:]
        assert "rollout fleet scaled from 2 to 1 engines" in trainer_log, trainer_log[-3000:]
        reasons = {e["reason"] for e in events_of(cp, fleet)}
        assert {"CreatingEngines", "ScaledDown"} <= reasons, reasons
        scaling = [e["message"] for e in events_of(cp, "scaled") if e["reason"] == "ScalingFleet"]
        assert f"scaling RolloutFleet {fleet} from 1 to 2 engine(s): the run's spec.rollout.replicas is 2" in scaling
        assert f"scaling RolloutFleet {fleet} from 2 to 1 engine(s): the run's spec.rollout.replicas is 1" in scaling
        # A scale-down that lands in a broadcast breaks its collective: it goes again over the engine that
        # stays (no fallback, as asserted above); named in that step's record.
        again = {step: syncs[str(step)]["scaled_away"] for step in slots_per_step if syncs[str(step)]["scaled_away"]}
        assert set(again) <= {one_again} and all(slots == [1] for slots in again.values()), again
        print(f"\nfigures: scaled up at step {up_at}, the new engine {second} served from step {min(two)}; "
              f"scaled down at step {down_at}, one engine from step {one_again} (broadcast again without the "
              f"engine scaled away: {again or 'no, between syncs'}); per-step sync seconds "
              f"{[syncs[str(s)]['seconds'] for s in range(1, SCALED_STEPS + 1)]}")
    finally:
        delete_and_wait(cp, "trainingrun", "scaled", "rlfleet.io/run=scaled", node_agent, operator)


def pod_log(agent, namespace: str, pod: str, container: str) -> str:
    logs = list((agent.log_path.parent / "logs").glob(f"{namespace}_{pod}_*/{container}.log"))
    return logs[0].read_text() if logs else ""


@pytest.mark.timeout(900)
def test_two_operator_replicas_with_peering_only_one_acts(control_plane, operator, node_agent):
    """The chart's operator pod (run by the node agent) and a local replica peer; one acts, then the other."""
    cp = control_plane
    operator.stop()
    helm(cp, "upgrade", "rlfleet", str(CHART), "-n", SYSTEM_NS, "--reuse-values",
         "--set", "peering.enabled=true", "--set", "operator.replicas=1")
    in_cluster = wait_for(lambda: [p for p in (get_json(cp, "pods", "-l", "app.kubernetes.io/component=operator",
                                                        namespace=SYSTEM_NS) or {}).get("items", [])
                                   if p["status"].get("phase") == "Running"],
                          timeout=120, what="the chart's operator pod to run")[0]["metadata"]["name"]
    operator.start("--peering", "rlfleet", "--priority", "50000")  # higher than any pod-name priority
    try:
        # Both replicas registered in the peering object; the lower priority (the pod's) stays paused.
        peers = wait_for(lambda: len(p := (get_json(cp, "kopfpeering", "rlfleet", namespace=NS) or {})
                                     .get("status") or {}) == 2 and p,
                         timeout=120, what="two peers in the KopfPeering object")
        assert sorted(v["priority"] for v in peers.values())[-1] == 50000
        unschedulable = fleet_manifest("rf-p", Path("/models/none"), replicas=2)
        unschedulable["spec"]["engine"]["nodeSelector"] = {"rlfleet.io/test": "nowhere"}
        apply(cp, unschedulable)
        wait_for(lambda: fleet_status(cp, "rf-p").get("replicas") == 2, timeout=60, what="2 pods")
        time.sleep(3)
        creating = [e for e in events_of(cp, "rf-p") if e["reason"] == "CreatingEngines"]
        assert len(creating) == 1, creating  # one active replica: one decision, one Event

        operator.stop()  # the active replica leaves; the paused one takes over
        wait_for(lambda: "Resuming operations" in pod_log(node_agent, SYSTEM_NS, in_cluster, "operator"),
                 timeout=120, what="the in-cluster replica to resume")
        cp.kubectl("scale", "rolloutfleet/rf-p", "-n", NS, "--replicas=3")
        wait_for(lambda: fleet_status(cp, "rf-p").get("replicas") == 3, timeout=120, what="slot 2 from the pod")
    finally:
        cp.kubectl("delete", "rolloutfleet", "rf-p", "-n", NS, "--wait=false", check=False)
        helm(cp, "upgrade", "rlfleet", str(CHART), "-n", SYSTEM_NS, "--reuse-values", "--set", "operator.replicas=0")
        operator.start()
