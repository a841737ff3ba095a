"""The node agent's pure rules: image map, env and $(VAR) expansion, volumes and paths, status."""
from pathlib import Path

import pytest

from rlfleet.devcluster.node_agent import plan

PY = "/opt/py/bin/python"


def pod(containers, volumes=None, **spec):
    return {
        "metadata": {"name": "f-engine-0", "namespace": "ns", "uid": "u-1", "labels": {"slot": "0"},
                     "annotations": {"a": "b"}},
        "spec": {"containers": containers, "volumes": volumes or [], **spec},
    }


def test_sglang_image_runs_python_as_this_interpreter():
    m = plan.ImageMap(plan.default_image_rules(PY))
    argv = m.local_argv("lmsysorg/sglang:v0.5.23", ["python3", "-m", "sglang.launch_server"], ["--port", "1"])
    assert argv == [PY, "-m", "sglang.launch_server", "--port", "1"]


def test_rlfleet_image_runs_the_local_cli():
    m = plan.ImageMap(plan.default_image_rules(PY))
    assert m.local_argv("ghcr.io/x/rlfleet:0.1", ["rlfleet", "run"], ["--kubernetes"]) == [
        PY, "-m", "rlfleet.cli", "run", "--kubernetes"]


@pytest.mark.parametrize("image,command,words", [
    ("busybox", ["sh"], "no local command map for image 'busybox'"),
    ("lmsysorg/sglang:x", ["bash", "-c", "x"], "command word 'bash' is not mapped"),
    ("lmsysorg/sglang:x", [], "has no command"),
])
def test_unmapped_images_and_words_are_refused_clearly(image, command, words):
    with pytest.raises(plan.PodConfigError) as e:
        plan.ImageMap(plan.default_image_rules(PY)).local_argv(image, command, [])
    assert e.value.reason == "ImageNotMapped"
    assert words in e.value.message


def test_extra_rules_from_json_come_first_and_bad_json_is_rejected():
    m = plan.ImageMap.from_json('{"busybox*": {"sh": ["/bin/sh"]}}', python=PY)
    assert m.local_argv("busybox:1", ["sh", "-c", "true"], []) == ["/bin/sh", "-c", "true"]
    with pytest.raises(ValueError, match="image map must be"):
        plan.ImageMap.from_json('{"busybox": {"sh": "/bin/sh"}}')


@pytest.mark.parametrize("text,expected", [
    ("--host=$(POD_IP)", "--host=127.0.0.12"),
    ("$(POD_IP):$(PORT)", "127.0.0.12:30000"),
    ("$$(POD_IP)", "$(POD_IP)"),
    ("$(UNKNOWN)", "$(UNKNOWN)"),
    ("plain", "plain"),
])
def test_var_expansion_follows_kubelet_rules(text, expected):
    assert plan.expand(text, {"POD_IP": "127.0.0.12", "PORT": "30000"}) == expected


def test_env_resolves_downward_api_and_earlier_vars():
    c = {"name": "engine", "env": [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "SLOT", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['slot']"}}},
        {"name": "URL", "value": "http://$(POD_IP):30000"},
        {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
    ]}
    env = plan.container_env(pod([c]), c, pod_ip="127.0.0.12", node_name="n1",
                             config_data={("configmap", "cfg"): {"k": "v"}})
    assert env == {"POD_IP": "127.0.0.12", "NAME": "f-engine-0", "SLOT": "0", "URL": "http://127.0.0.12:30000",
                   "CM": "v"}


def test_env_with_a_missing_config_key_is_a_config_error():
    c = {"name": "c", "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    with pytest.raises(plan.PodConfigError, match="secret 's' key 'k' not found"):
        plan.container_env(pod([c]), c, pod_ip="1", node_name="n")


def test_volumes_map_to_host_directories_and_claims_are_shared(tmp_path):
    vols = [{"name": "snap", "persistentVolumeClaim": {"claimName": "run-snapshots"}},
            {"name": "scratch", "emptyDir": {}}, {"name": "host", "hostPath": {"path": "/data/models"}}]
    paths = plan.volume_host_paths(pod([], vols), tmp_path, allow_host_path=True)
    assert paths == {"snap": tmp_path / "claims" / "ns" / "run-snapshots",
                     "scratch": tmp_path / "pods" / "u-1" / "volumes" / "scratch",
                     "host": Path("/data/models")}
    with pytest.raises(plan.PodConfigError, match="unsupported source"):
        plan.volume_host_paths(pod([], [{"name": "x", "nfs": {}}]), tmp_path)


def test_host_path_volumes_are_refused_unless_the_agent_allows_them(tmp_path):
    vols = [{"name": "host", "hostPath": {"path": "/data/models"}}]
    with pytest.raises(plan.PodConfigError, match="hostPath volumes are refused.*--allow-host-path") as e:
        plan.volume_host_paths(pod([], vols), tmp_path)
    assert e.value.reason == "HostPathNotAllowed"


@pytest.mark.parametrize("claim", ["../../../.cache/x", "..", "a/../../b", "a/b", "/etc", "UPPER", "a..b/.."])
def test_a_claim_name_that_is_no_dns_subdomain_is_refused(tmp_path, claim):
    vols = [{"name": "snap", "persistentVolumeClaim": {"claimName": claim}}]
    with pytest.raises(plan.PodConfigError, match="claim name .* is not a DNS-1123 subdomain") as e:
        plan.volume_host_paths(pod([], vols), tmp_path)
    assert e.value.reason == "PathOutsideDataDir"


def test_a_volume_name_that_would_leave_the_pod_directory_is_refused(tmp_path):
    with pytest.raises(plan.PodConfigError, match="not a DNS-1123 label") as e:
        plan.volume_host_paths(pod([], [{"name": "../../x", "emptyDir": {}}]), tmp_path)
    assert e.value.reason == "PathOutsideDataDir"


def test_confined_folds_dots_and_refuses_what_leaves_the_root(tmp_path):
    root = tmp_path / "claims" / "ns"
    assert plan.confined(root / "a" / "." / "b", root, "x") == root / "a" / "b"
    assert plan.confined(root, root, "x") == root
    for escape in (root / ".." / "other", root / "a" / ".." / ".." / "x", Path("/etc/passwd"),
                   Path(str(root) + "-sibling")):
        with pytest.raises(plan.PodConfigError, match="outside"):
            plan.confined(escape, root, "x")
    # A symbolic link planted in a claim: the caller resolves it, the rule is the same.
    with pytest.raises(plan.PodConfigError, match="after symbolic links"):
        plan.check_resolved(Path("/home/u/.cache"), root, "volume 'snap'")


@pytest.mark.parametrize("sub", ["../other-claim", "/etc", "a/../../x"])
def test_a_sub_path_outside_its_volume_is_refused(tmp_path, sub):
    c = {"name": "c", "volumeMounts": [{"name": "snap", "mountPath": "/s", "subPath": sub}]}
    with pytest.raises(plan.PodConfigError, match="subPath") as e:
        plan.mount_table(c, {"snap": tmp_path / "claims" / "ns" / "c"})
    assert e.value.reason == "PathOutsideDataDir"
    ok = {"name": "c", "volumeMounts": [{"name": "snap", "mountPath": "/s", "subPath": "models/m1"}]}
    assert plan.mount_table(ok, {"snap": tmp_path}) == [("/s", tmp_path / "models" / "m1")]


def test_secret_files_are_owner_only_and_keys_cannot_leave_their_directory(tmp_path):
    assert plan.config_files(tmp_path, {"token": "t", "ca.crt": "c"}, secret=True) == [
        (tmp_path / "token", "t", 0o600), (tmp_path / "ca.crt", "c", 0o600)]
    assert plan.config_files(tmp_path, {"cfg.json": "{}"}, secret=False) == [(tmp_path / "cfg.json", "{}", 0o644)]
    for key in ("..", "../x", "a/b", "..data"):
        with pytest.raises(plan.PodConfigError, match="not a plain file name"):
            plan.config_files(tmp_path, {key: "v"}, secret=True)


def test_a_working_dir_under_no_mount_is_refused(tmp_path):
    c = {"name": "c", "image": "rlfleet/rlfleet", "command": ["rlfleet"], "workingDir": "/root"}
    with pytest.raises(plan.PodConfigError, match="workingDir '/root' is under no volume mount") as e:
        plan.plan_container(pod([c]), c, pod_ip="127.0.0.12", node_name="n", volume_paths={},
                            image_map=plan.ImageMap(plan.default_image_rules(PY)))
    assert e.value.reason == "PathOutsideDataDir"


def test_the_process_environment_is_the_runtimes_then_the_pod_specs_and_nothing_else(tmp_path):
    home = plan.pod_home(tmp_path, "u-1")
    assert home == tmp_path / "pods" / "u-1" / "home"
    base = plan.runtime_env(pod_name="f-engine-0", home=home, python=PY, kubeconfig=tmp_path / "kc")
    assert base == {"PATH": "/opt/py/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "HOME": str(home), "HOSTNAME": "f-engine-0", "LANG": "C.UTF-8", "KUBECONFIG": str(tmp_path / "kc")}
    assert "KUBECONFIG" not in plan.runtime_env(pod_name="p", home=home, python=PY)
    c = {"name": "c", "image": "rlfleet/rlfleet", "command": ["rlfleet"],
         "env": [{"name": "LANG", "value": "en_US.UTF-8"}, {"name": "TOKEN_FILE", "value": "$(HOME)/t"}]}
    cp = plan.plan_container(pod([c]), c, pod_ip="127.0.0.12", node_name="n", volume_paths={},
                             image_map=plan.ImageMap(plan.default_image_rules(PY)), extra_env=base)
    # The pod spec wins; $(VAR) sees only the spec's earlier variables, as in Kubernetes.
    assert cp.env == {**base, "LANG": "en_US.UTF-8", "TOKEN_FILE": "$(HOME)/t"}


def test_paths_under_mounts_are_rewritten_in_args_flags_env_and_cwd(tmp_path):
    c = {"name": "engine", "image": "lmsysorg/sglang:1", "workingDir": "/snapshots",
         "command": ["python3", "-m", "sglang.launch_server"],
         "args": ["--model-path", "/snapshots/step_3", "--download-dir=/snapshots/cache", "--x", "/snapshotsX"],
         "env": [{"name": "SNAP", "value": "/snapshots"}],
         "volumeMounts": [{"name": "snap", "mountPath": "/snapshots"}]}
    p = pod([c], [{"name": "snap", "persistentVolumeClaim": {"claimName": "c"}}])
    vp = plan.volume_host_paths(p, tmp_path)
    cp = plan.plan_container(p, c, pod_ip="127.0.0.12", node_name="n", volume_paths=vp,
                             image_map=plan.ImageMap(plan.default_image_rules(PY)), extra_env={"HOSTNAME": "h"})
    host = str(tmp_path / "claims" / "ns" / "c")
    assert cp.argv == [PY, "-m", "sglang.launch_server", "--model-path", host + "/step_3",
                       f"--download-dir={host}/cache", "--x", "/snapshotsX"]
    assert cp.env == {"HOSTNAME": "h", "SNAP": host}
    assert cp.cwd == host


def test_readiness_probe_uses_pod_ip_and_named_ports():
    c = {"name": "e", "ports": [{"name": "http", "containerPort": 30000}],
         "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2,
                            "failureThreshold": 5}}
    probe = plan.readiness_probe(c, "127.0.0.12")
    assert probe.url == "http://127.0.0.12:30000/health"
    assert (probe.period_s, probe.failure_threshold, probe.timeout_s) == (2.0, 5, 1.0)
    assert plan.readiness_probe({"name": "e"}, "127.0.0.12") is None
    with pytest.raises(plan.PodConfigError, match="only httpGet"):
        plan.readiness_probe({"name": "e", "readinessProbe": {"exec": {"command": ["true"]}}}, "x")


def test_ip_pool_gives_each_pod_its_own_address_and_reuses_released_ones():
    pool = plan.PodIpPool("127.0.0.0/24", first_host=10)
    a, b = pool.take("a"), pool.take("b")
    assert (a, b) == ("127.0.0.10", "127.0.0.11")
    assert pool.take("a") == a
    pool.release("a")
    assert pool.take("c", unusable=["127.0.0.10"]) == "127.0.0.12"
    assert pool.take("d", preferred="127.0.0.10") == "127.0.0.10"
    with pytest.raises(ValueError, match="not a loopback"):
        plan.PodIpPool("10.0.0.0/24")


def test_ip_pool_exhaustion_is_a_clear_error():
    pool = plan.PodIpPool("127.0.0.0/29", first_host=5)
    pool.take("a"), pool.take("b")
    with pytest.raises(plan.PodConfigError, match="no free address"):
        pool.take("c")


def test_ip_pool_rejects_a_first_host_past_the_network():
    assert plan.PodIpPool("127.0.0.0/24", first_host=254).take("a") == "127.0.0.254"
    with pytest.raises(ValueError, match="first host 255 leaves no pod address in 127.0.0.0/24"):
        plan.PodIpPool("127.0.0.0/24", first_host=255)


@pytest.mark.parametrize("policy,codes,phase", [
    ("Never", [0], "Succeeded"),
    ("Never", [0, 3], "Failed"),
    ("Never", [None], "Running"),
    ("OnFailure", [1], "Running"),
    ("OnFailure", [0], "Succeeded"),
    ("Always", [0], "Running"),
])
def test_pod_phase(policy, codes, phase):
    runs = [plan.ContainerRun(f"c{i}", "img", started_at="t", exit_code=c, waiting_reason=None)
            for i, c in enumerate(codes)]
    assert plan.pod_phase(policy, runs) == phase


def test_pod_phase_is_pending_until_every_container_started():
    assert plan.pod_phase("Never", [plan.ContainerRun("c", "img")]) == "Pending"


def test_status_reports_ready_exit_code_and_log_tail():
    run = plan.ContainerRun("engine", "img", started_at="t0", exit_code=3, finished_at="t1",
                            message=plan.termination_message(["a", "AssertionError: no backend"]), waiting_reason=None)
    st = plan.pod_status(phase="Failed", pod_ip="127.0.0.12", start_time="t0", runs=[run], now="t2")
    term = st["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 3 and term["reason"] == "Error"
    assert term["message"].endswith("AssertionError: no backend")
    ready = {c["type"]: c for c in st["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "PodCompleted"
    assert st["podIP"] == "127.0.0.12"


def test_ready_condition_keeps_its_transition_time_while_unchanged():
    run = plan.ContainerRun("e", "img", started_at="t0", ready=True, waiting_reason=None)
    first = plan.pod_status(phase="Running", pod_ip="ip", start_time="t0", runs=[run], now="t1")
    again = plan.pod_status(phase="Running", pod_ip="ip", start_time="t0", runs=[run], now="t9",
                            previous_conditions=first["conditions"])
    ready = {c["type"]: c for c in again["conditions"]}["Ready"]
    assert ready == {"type": "Ready", "status": "True", "lastTransitionTime": "t1", "lastProbeTime": None}
    assert again["containerStatuses"][0]["state"] == {"running": {"startedAt": "t0"}}


def test_termination_message_keeps_the_end():
    msg = plan.termination_message(["x" * 5000, "the reason"], max_bytes=100)
    assert len(msg.encode()) <= 100 and msg.endswith("the reason")


def test_restart_backoff_doubles_to_a_cap():
    assert [plan.restart_delay_s(n, 1, 8) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 8, 8]
    assert plan.should_restart("OnFailure", 1) and not plan.should_restart("OnFailure", 0)
    assert not plan.should_restart("Never", 1) and plan.should_restart("Always", 0)


def test_scheduler_binds_only_unbound_matching_pods():
    p = pod([], nodeSelector={"rlfleet.io/node-agent": "true"})
    assert plan.schedulable_here(p, {"rlfleet.io/node-agent": "true"})
    assert not plan.schedulable_here(p, {})
    assert not plan.schedulable_here(pod([], nodeName="other"), {})
    assert not plan.schedulable_here(pod([], schedulerName="volcano"), {})


def test_a_refused_pod_gets_a_warning_event_naming_why():
    ev = plan.pod_event(pod([]), "PathOutsideDataDir", "claim name '..' ...", node="n1", now="2026-01-01T00:00:00Z")
    assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "f-engine-0", "namespace": "ns",
                                    "uid": "u-1"}
    assert (ev["type"], ev["reason"], ev["message"]) == ("Warning", "PathOutsideDataDir", "claim name '..' ...")
    assert ev["source"] == {"component": "kubelet", "host": "n1"}


def test_liveness_and_startup_probes_are_read_like_readiness():
    c = {"name": "e", "ports": [{"name": "http", "containerPort": 30000}],
         "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 91},
         "livenessProbe": {"httpGet": {"path": "/health_generate", "port": 30000}, "periodSeconds": 2,
                           "timeoutSeconds": 3, "failureThreshold": 2}}
    probes = plan.container_probes(c, "127.0.0.12")
    assert probes.readiness is None
    assert probes.startup.url == "http://127.0.0.12:30000/health" and probes.startup.failure_threshold == 91
    assert probes.liveness.url == "http://127.0.0.12:30000/health_generate"
    assert (probes.liveness.period_s, probes.liveness.timeout_s, probes.liveness.failure_threshold) == (2, 3, 2)
    with pytest.raises(plan.PodConfigError, match="only httpGet liveness probes"):
        plan.container_probes({"name": "e", "livenessProbe": {"tcpSocket": {"port": 1}}}, "x")
