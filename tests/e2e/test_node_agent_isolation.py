"""The dev cluster's node agent keeps pods to themselves: a pod's processes do not see the agent's environment
(the admin kubeconfig owner's), secret files are the owner's only, and a pod whose claim name, or hostPath
volume, would reach outside the agent's data dir is refused with the reason on its status and an Event.

Real kube-apiserver + etcd + controller-manager (`control_plane`), the real node agent as a process, pods
run as real local processes. No engines.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.cluster import get_json, start_node_agent, stop_node_agent, wait_for

pytestmark = pytest.mark.cluster

NS = "agent-isolation"
AGENT_SECRET = "RLFLEET_TEST_AGENT_SECRET"
# Prints the process's whole environment, the secret file's mode and the working directory as one line.
# (The mount path reaches the process through $CREDS: the agent maps mount paths in env values and arguments.)
PROBE = ("import json, os, stat; d = os.environ['CREDS']; "
         "print(json.dumps({'env': dict(os.environ), 'mode': stat.S_IMODE(os.stat(d + '/token').st_mode), "
         "'secret_dir_mode': stat.S_IMODE(os.stat(d).st_mode), 'file_content': open(d + '/token').read()}))")


def pod(name: str, volumes: list[dict], mounts: list[dict], command: list[str], env: list[dict] | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2, "volumes": volumes,
                     "containers": [{"name": "main", "image": "ghcr.io/example/rlfleet:dev", "command": command,
                                     "env": env or [], "volumeMounts": mounts}]}}


@pytest.fixture(scope="module")
def node(control_plane, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("isolation-node")
    agent = start_node_agent(control_plane, data_dir, first_host=180, env={AGENT_SECRET: "s3cr3t-of-the-admin"})
    yield data_dir, agent
    left = stop_node_agent(agent, data_dir)
    assert left == 0, f"the node agent left {left} pod process group(s) running"


def create(cp, obj: dict) -> None:
    # The namespace's default ServiceAccount (which admission requires) comes from a controller.
    wait_for(lambda: cp.kubectl("apply", "-f", "-", input=json.dumps(obj), check=False).returncode == 0,
             timeout=30, interval=0.5, what=f"pod {obj['metadata']['name']} to be admitted")


def pod_status(cp, name: str) -> dict:
    return (get_json(cp, "pod", name, namespace=NS) or {}).get("status", {})


def warning_reasons(cp, name: str) -> dict[str, str]:
    events = get_json(cp, "events", "--field-selector", f"involvedObject.name={name}", namespace=NS) or {}
    return {e["reason"]: e["message"] for e in events.get("items", []) if e["type"] == "Warning"}


def test_a_pod_sees_only_its_own_environment_and_secret_files_are_private(control_plane, node):
    cp = control_plane
    data_dir, agent = node
    cp.kubectl("create", "namespace", NS, check=False)
    cp.kubectl("create", "secret", "generic", "creds", "-n", NS, "--from-literal=token=t0ken")
    create(cp, pod("env-probe", [{"name": "creds", "secret": {"secretName": "creds"}}],
                   [{"name": "creds", "mountPath": "/etc/creds"}], ["python", "-c", PROBE],
                   env=[{"name": "FROM_SPEC", "value": "yes"}, {"name": "CREDS", "value": "/etc/creds"}]))
    status = wait_for(lambda: (s := pod_status(cp, "env-probe")).get("phase") in ("Succeeded", "Failed") and s,
                      timeout=60, interval=0.5, what="pod env-probe to finish",
                      context=lambda: "\n".join(agent.tail(30)))
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert status["phase"] == "Succeeded", terminated
    seen = json.loads(terminated["message"].strip().splitlines()[-1])
    env = seen["env"]
    assert AGENT_SECRET not in env and "s3cr3t-of-the-admin" not in json.dumps(env)
    assert set(env) == {"PATH", "HOME", "HOSTNAME", "LANG", "KUBECONFIG", "FROM_SPEC", "CREDS"}, sorted(env)
    assert env["FROM_SPEC"] == "yes" and env["HOSTNAME"] == "env-probe" and env["LANG"] == "C.UTF-8"
    home, kubeconfig = Path(env["HOME"]), Path(env["KUBECONFIG"])
    assert home.is_relative_to(data_dir.resolve() / "pods") and home.name == "home"
    assert kubeconfig.is_relative_to(data_dir.resolve() / "pods")
    assert env["PATH"].endswith(":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    assert (seen["mode"], seen["secret_dir_mode"], seen["file_content"]) == (0o600, 0o700, "t0ken")


@pytest.mark.parametrize(("name", "volume", "reason", "says"), [
    ("crafted-claim", {"persistentVolumeClaim": {"claimName": "../../../../escaped"}}, "PathOutsideDataDir",
     "claim name '../../../../escaped' is not a DNS-1123 subdomain"),
    ("host-path", {"hostPath": {"path": "/etc"}}, "HostPathNotAllowed", "hostPath volumes are refused"),
])
def test_a_pod_reaching_outside_the_data_dir_is_refused_and_says_why(control_plane, node, name, volume, reason,
                                                                    says):
    cp = control_plane
    data_dir, agent = node
    cp.kubectl("create", "namespace", NS, check=False)
    marker = "touched-by-" + name
    create(cp, pod(name, [{"name": "data", **volume}], [{"name": "data", "mountPath": "/data"}],
                   ["python", "-c", f"open('/data/{marker}', 'w')"]))
    status = wait_for(lambda: (s := pod_status(cp, name)).get("reason") and s, timeout=60, interval=0.5,
                      what=f"pod {name} to be refused", context=lambda: "\n".join(agent.tail(30)))
    assert status["phase"] == "Pending" and status["reason"] == reason, status
    assert says in status["message"]
    waiting = status["containerStatuses"][0]["state"]["waiting"]
    assert waiting["reason"] == reason and says in waiting["message"]
    events = wait_for(lambda: warning_reasons(cp, name).get(reason) and warning_reasons(cp, name), timeout=30,
                      interval=0.5, what=f"a Warning Event {reason} on pod {name}")
    assert says in events[reason]
    # Nothing ran, nothing was made where the crafted name points.
    assert not (data_dir / "claims" / NS / "../../../../escaped").exists()
    assert not Path(f"/etc/{marker}").exists()
    cp.kubectl("delete", "pod", name, "-n", NS, "--wait=true", "--timeout=60s")
