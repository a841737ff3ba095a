"""Pure rules of the local node agent: how a pod spec becomes local processes, and its status.

The node agent (`rlfleet.devcluster.node_agent.agent`) stands in for the kubelet on one machine. This module
holds every decision it makes, without I/O, so each rule is unit-tested:

Image -> local command map (`ImageMap`)
    A container's image selects which local programs its command may name. The command's first
    word is looked up in the rule of the first matching image pattern and replaced by a local argv:

    =====================  ===========================  ==========================================
    image pattern          command word                 runs locally as
    =====================  ===========================  ==========================================
    ``*sglang*``           ``python``, ``python3``      this interpreter (``sys.executable``), so
                                                        ``python3 -m sglang.launch_server`` runs the
                                                        SGLang installed next to rlfleet
    ``*rlfleet*``          ``rlfleet``                  ``<python> -m rlfleet.cli``
    ``*rlfleet*``          ``python``, ``python3``      this interpreter
    =====================  ===========================  ==========================================

    Extra rules come from ``--image-map FILE`` (JSON ``{"pattern": {"word": ["argv", ...]}}``) and are
    tried first. An image with no rule, or a command word its rule does not name, fails the container
    with reason ``ImageNotMapped`` and says which image and word were missing.

Pod address
    Each pod gets its own loopback address 127.0.0.N (``PodIpPool``), written to ``status.podIP``. The
    agent resolves the downward API (``fieldRef: status.podIP`` and the other common field paths) and
    expands ``$(VAR)`` references in command and args as the kubelet does, so ``--host $(POD_IP)``
    binds the pod's own address.

Volumes and paths
    ``emptyDir`` -> ``<data>/pods/<uid>/volumes/<name>``; ``persistentVolumeClaim`` ->
    ``<data>/claims/<namespace>/<claim>`` (one directory per claim, shared by every pod that mounts it,
    e.g. the trainer and the engines share the snapshot volume); ``hostPath`` -> its path;
    ``configMap``/``secret`` -> files written from their data. Processes cannot see a pod's mount
    paths, so every argument, env value and ``workingDir`` that is a mount path or lies under one
    is rewritten to the host directory.

API access from a pod
    Instead of a token file under /var/run/secrets, a pod whose service account token is mounted
    (the default) gets ``KUBECONFIG`` pointing at a kubeconfig holding a token of its own service
    account (TokenRequest API), so in-pod clients use the pod's RBAC, as in a cluster.
"""
from __future__ import annotations

import fnmatch
import ipaddress
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

TERMINATION_MESSAGE_MAX_BYTES = 4096  # the kubelet's limit per container
TERMINATION_MESSAGE_LINES = 20
NODE_ADDRESS = "127.0.0.1"  # the Node's InternalIP: the agent's log endpoint listens there


class PodConfigError(ValueError):
    """A container cannot be run locally; `reason` becomes the container's waiting reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


# Image map ------------------------------------------------------------------------------------------
def default_image_rules(python: str | None = None) -> list[tuple[str, dict[str, list[str]]]]:
    py = python or sys.executable
    return [
        ("*sglang*", {"python": [py], "python3": [py]}),
        ("*rlfleet*", {"rlfleet": [py, "-m", "rlfleet.cli"], "python": [py], "python3": [py]}),
    ]


@dataclass
class ImageMap:
    """Ordered (image glob, {command word: local argv prefix}) rules; first matching image wins."""

    rules: list[tuple[str, dict[str, list[str]]]] = field(default_factory=default_image_rules)

    @classmethod
    def with_extra(cls, extra: Mapping[str, Mapping[str, list[str]]] | None, python: str | None = None) -> ImageMap:
        rules = [(pat, {w: list(a) for w, a in words.items()}) for pat, words in (extra or {}).items()]
        return cls(rules + default_image_rules(python))

    @classmethod
    def from_json(cls, text: str, python: str | None = None) -> ImageMap:
        data = json.loads(text)
        if not isinstance(data, dict) or not all(
            isinstance(w, dict) and all(isinstance(a, list) and a and all(isinstance(s, str) for s in a)
                                        for a in w.values()) for w in data.values()):
            raise ValueError('image map must be {"image-pattern": {"command-word": ["argv", ...]}}')
        return cls.with_extra(data, python)

    def local_argv(self, image: str, command: list[str], args: list[str]) -> list[str]:
        words = list(command) + list(args)
        if not command:
            raise PodConfigError("ImageNotMapped", f"container of image {image!r} has no command; the node agent "
                                 "runs only explicit commands (it cannot read image entrypoints)")
        for pattern, table in self.rules:
            if fnmatch.fnmatchcase(image, pattern):
                head = words[0]
                if head not in table:
                    raise PodConfigError("ImageNotMapped", f"image {image!r} (rule {pattern!r}) maps only "
                                         f"{sorted(table)}; command word {head!r} is not mapped")
                return list(table[head]) + words[1:]
        raise PodConfigError("ImageNotMapped", f"no local command map for image {image!r}")


# $(VAR) expansion (the kubelet's rules) --------------------------------------------------------------
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Expand $(VAR) from env; `$$` is a literal `$`; unknown references stay as written."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(sub, value)


# Environment -----------------------------------------------------------------------------------------
def field_value(pod: dict, field_path: str, *, pod_ip: str, node_name: str) -> str:
    meta = pod.get("metadata", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": node_name,
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": "127.0.0.1",
        "status.hostIPs": "127.0.0.1",
    }
    if field_path in simple:
        return simple[field_path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise PodConfigError("CreateContainerConfigError", f"unsupported fieldRef {field_path!r}")


def container_env(pod: dict, container: dict, *, pod_ip: str, node_name: str,
                  config_data: Mapping[tuple[str, str], Mapping[str, str]] | None = None) -> dict[str, str]:
    """The container's environment in declaration order, with $(VAR) expanded against earlier ones.

    config_data maps ("configmap"|"secret", name) -> data, for configMapKeyRef/secretKeyRef.
    """
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" in var:
            src = var["valueFrom"]
            if "fieldRef" in src:
                env[name] = field_value(pod, src["fieldRef"]["fieldPath"], pod_ip=pod_ip, node_name=node_name)
                continue
            for kind, key in (("configmap", "configMapKeyRef"), ("secret", "secretKeyRef")):
                if key in src:
                    ref = src[key]
                    data = (config_data or {}).get((kind, ref["name"]))
                    if data is None or ref["key"] not in data:
                        if ref.get("optional"):
                            break
                        raise PodConfigError("CreateContainerConfigError",
                                             f"{kind} {ref['name']!r} key {ref['key']!r} not found")
                    env[name] = data[ref["key"]]
                    break
            else:
                raise PodConfigError("CreateContainerConfigError", f"unsupported valueFrom for env {name!r}")
        else:
            env[name] = expand(var.get("value", ""), env)
    return env


# Volumes ---------------------------------------------------------------------------------------------
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_FILE_KEY = re.compile(r"[-._a-zA-Z0-9]+")
OUTSIDE = "PathOutsideDataDir"
HOST_PATH_REFUSED = "HostPathNotAllowed"


def confined(path: Path, root: Path, what: str) -> Path:
    """path, if it lies under root once `.` and `..` are folded (no I/O); else PodConfigError."""
    folded = Path(os.path.normpath(path))
    base = Path(os.path.normpath(root))
    if folded != base and base not in folded.parents:
        raise PodConfigError(OUTSIDE, f"{what} resolves to {folded}, outside {base}: refused")
    return folded


def check_resolved(resolved: Path, root_resolved: Path, what: str) -> None:
    """After symbolic links are resolved (the caller's I/O), the path must still lie under the root."""
    confined(resolved, root_resolved, what + " (after symbolic links)")


def volume_host_paths(pod: dict, data_dir: Path, *, allow_host_path: bool = False) -> dict[str, Path]:
    """Host directory of every volume of the pod (configMap/secret: a per-pod directory to fill)."""
    meta = pod["metadata"]
    pod_dir = data_dir / "pods" / meta["uid"] / "volumes"
    claims = data_dir / "claims" / meta["namespace"]
    paths: dict[str, Path] = {}
    for vol in pod.get("spec", {}).get("volumes") or []:
        name = vol["name"]
        if "hostPath" in vol:
            if not allow_host_path:
                raise PodConfigError(HOST_PATH_REFUSED, f"volume {name!r}: hostPath volumes are refused by this "
                                     "node agent (start it with --allow-host-path to map them)")
            paths[name] = Path(vol["hostPath"]["path"])
            continue
        if not _DNS1123_LABEL.fullmatch(name) or len(name) > 63:
            raise PodConfigError(OUTSIDE, f"volume name {name!r} is not a DNS-1123 label: refused")
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            if not _DNS1123_SUBDOMAIN.fullmatch(claim) or len(claim) > 253:
                raise PodConfigError(OUTSIDE, f"volume {name!r}: claim name {claim!r} is not a DNS-1123 "
                                     f"subdomain; it would map outside {claims}: refused")
            paths[name] = confined(claims / claim, claims, f"volume {name!r} (claim {claim!r})")
        elif any(k in vol for k in ("emptyDir", "configMap", "secret", "projected", "downwardAPI")):
            paths[name] = confined(pod_dir / name, pod_dir, f"volume {name!r}")
        else:
            kinds = sorted(set(vol) - {"name"})
            raise PodConfigError("CreateContainerConfigError", f"volume {name!r}: unsupported source {kinds}")
    return paths


def config_files(directory: Path, data: Mapping[str, str], *, secret: bool) -> list[tuple[Path, str, int]]:
    """(file, text, mode) of a configMap/secret volume: one file per key, secrets readable by the owner only."""
    files = []
    for key, value in data.items():
        if not _FILE_KEY.fullmatch(key) or key in (".", "..") or key.startswith(".."):
            raise PodConfigError(OUTSIDE, f"key {key!r} of a {'secret' if secret else 'configMap'} volume is not a "
                                 "plain file name: refused")
        files.append((confined(directory / key, directory, f"key {key!r}"), value, 0o600 if secret else 0o644))
    return files


def mount_table(container: dict, volume_paths: Mapping[str, Path]) -> list[tuple[str, Path]]:
    """(mountPath, host path) pairs, longest mount path first (the most specific wins)."""
    table = []
    for m in container.get("volumeMounts") or []:
        if m["name"] not in volume_paths:
            raise PodConfigError("CreateContainerConfigError", f"volumeMount of unknown volume {m['name']!r}")
        host = volume_paths[m["name"]]
        sub = m.get("subPath")
        if sub:
            if sub.startswith("/") or ".." in Path(sub).parts:
                raise PodConfigError(OUTSIDE, f"volumeMount {m['mountPath']!r}: subPath {sub!r} must be relative "
                                     "without '..': refused")
            host = confined(host / sub, host, f"volumeMount {m['mountPath']!r} subPath {sub!r}")
        table.append((m["mountPath"].rstrip("/") or "/", host))
    return sorted(table, key=lambda t: -len(t[0]))


def translate_path(value: str, mounts: Iterable[tuple[str, Path]]) -> str:
    """Rewrite a value that is a mount path or lies under one (also `--flag=PATH`) to the host path."""
    head, path = "", value
    if value.startswith("-") and "=" in value:
        flag, _, path = value.partition("=")
        head = flag + "="
    for mount, host in mounts:
        if path == mount or path.startswith(mount + "/"):
            return head + str(host) + path[len(mount):]
    return value


# Environment of a container process --------------------------------------------------------------------
RUNTIME_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def pod_home(data_dir: Path, uid: str) -> Path:
    return data_dir / "pods" / uid / "home"


def runtime_env(*, pod_name: str, home: Path, python: str | None = None,
                kubeconfig: Path | None = None) -> dict[str, str]:
    """What a container runtime and the kubelet set before the pod spec's env (see the module docstring)."""
    env = {"PATH": f"{Path(python or sys.executable).parent}:{RUNTIME_PATH}", "HOME": str(home),
           "HOSTNAME": pod_name, "LANG": "C.UTF-8"}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return env


# The whole plan for one container --------------------------------------------------------------------
@dataclass(frozen=True)
class ContainerPlan:
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    mounts: list[tuple[str, Path]]


def plan_container(pod: dict, container: dict, *, pod_ip: str, node_name: str, volume_paths: Mapping[str, Path],
                   image_map: ImageMap, extra_env: Mapping[str, str] | None = None,
                   config_data: Mapping[tuple[str, str], Mapping[str, str]] | None = None) -> ContainerPlan:
    """Everything needed to start one container as a local process. Raises PodConfigError.

    extra_env (runtime_env's) comes first; the pod spec's env overrides it. The result is the whole
    environment of the process: nothing of the agent's own is added."""
    mounts = mount_table(container, volume_paths)
    env = container_env(pod, container, pod_ip=pod_ip, node_name=node_name, config_data=config_data)
    env = {k: translate_path(v, mounts) for k, v in env.items()}
    command = [expand(w, env) for w in container.get("command") or []]
    args = [expand(w, env) for w in container.get("args") or []]
    argv = image_map.local_argv(container.get("image", ""), command, args)
    argv = [argv[0]] + [translate_path(a, mounts) for a in argv[1:]]
    full_env = dict(extra_env or {})
    full_env.update(env)
    cwd = container.get("workingDir")
    if cwd and translate_path(cwd, mounts) == cwd:
        raise PodConfigError(OUTSIDE, f"workingDir {cwd!r} is under no volume mount; it would be a directory of the "
                             "node's own file system: refused")
    return ContainerPlan(container["name"], argv, full_env, translate_path(cwd, mounts) if cwd else None, mounts)


# Probes ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HttpProbe:
    url: str
    initial_delay_s: float
    period_s: float
    timeout_s: float
    failure_threshold: int
    success_threshold: int


@dataclass(frozen=True)
class ContainerProbes:
    """A container's probes, kubelet semantics: `startup` first (until it passes, neither of the others
    runs; failing it kills the container); then `readiness` (Ready or not) and `liveness` (failing it kills
    the container). None: that probe is not set."""

    startup: HttpProbe | None
    readiness: HttpProbe | None
    liveness: HttpProbe | None


def container_probes(container: dict, pod_ip: str) -> ContainerProbes:
    return ContainerProbes(startup=http_probe(container, "startupProbe", pod_ip),
                           readiness=http_probe(container, "readinessProbe", pod_ip),
                           liveness=http_probe(container, "livenessProbe", pod_ip))


def readiness_probe(container: dict, pod_ip: str) -> HttpProbe | None:
    """The container's httpGet readiness probe against the pod address (None: ready once started)."""
    return http_probe(container, "readinessProbe", pod_ip)


def http_probe(container: dict, field: str, pod_ip: str) -> HttpProbe | None:
    """The container's httpGet probe `field` (readinessProbe, livenessProbe, startupProbe) against the pod
    address; None when it has none."""
    probe = container.get(field)
    if not probe:
        return None
    what = field.removesuffix("Probe")
    http = probe.get("httpGet")
    if not http:
        raise PodConfigError("CreateContainerConfigError", f"only httpGet {what} probes are supported")
    port = http["port"]
    if isinstance(port, str) and not port.isdigit():
        named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        if port not in named:
            raise PodConfigError("CreateContainerConfigError", f"{what} probe names unknown port {port!r}")
        port = named[port]
    host = http.get("host") or pod_ip
    scheme = http.get("scheme", "HTTP").lower()
    path = http.get("path", "/")
    return HttpProbe(
        url=f"{scheme}://{host}:{int(port)}{path if path.startswith('/') else '/' + path}",
        initial_delay_s=float(probe.get("initialDelaySeconds", 0)),
        period_s=float(probe.get("periodSeconds", 10)),
        timeout_s=float(probe.get("timeoutSeconds", 1)),
        failure_threshold=int(probe.get("failureThreshold", 3)),
        success_threshold=int(probe.get("successThreshold", 1)),
    )


# Pod addresses ---------------------------------------------------------------------------------------
class PodIpPool:
    """Hands out loopback addresses of a network to pods, one each, never the network/broadcast ones."""

    def __init__(self, network: str = "127.0.0.0/24", first_host: int = 10):
        self.network = ipaddress.ip_network(network)
        if not self.network.is_loopback:
            raise ValueError(f"pod network {network} is not a loopback network")
        self._candidates = [str(ip) for i, ip in enumerate(self.network.hosts()) if i + 1 >= first_host]
        if not self._candidates:
            raise ValueError(f"first host {first_host} leaves no pod address in {network}")
        self._taken: dict[str, str] = {}  # ip -> pod uid

    def take(self, uid: str, preferred: str | None = None, unusable: Iterable[str] = ()) -> str:
        for ip, owner in self._taken.items():
            if owner == uid:
                return ip
        bad = set(unusable)
        if preferred and preferred in self._candidates and preferred not in self._taken and preferred not in bad:
            self._taken[preferred] = uid
            return preferred
        for ip in self._candidates:
            if ip not in self._taken and ip not in bad:
                self._taken[ip] = uid
                return ip
        raise PodConfigError("PodIPsExhausted", f"no free address left in {self.network}")

    def release(self, uid: str) -> None:
        for ip in [ip for ip, owner in self._taken.items() if owner == uid]:
            del self._taken[ip]

    def in_use(self) -> dict[str, str]:
        return dict(self._taken)


# Status ----------------------------------------------------------------------------------------------
@dataclass
class ContainerRun:
    """What the agent knows about one container; turned into a containerStatus."""

    name: str
    image: str
    started_at: str | None = None
    ready: bool = False
    exit_code: int | None = None
    finished_at: str | None = None
    message: str = ""
    waiting_reason: str | None = "ContainerCreating"
    waiting_message: str = ""
    restart_count: int = 0
    last_terminated: dict | None = None

    def terminated_state(self) -> dict:
        return {
            "exitCode": self.exit_code,
            "reason": "Completed" if self.exit_code == 0 else "Error",
            "message": self.message,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
        }

    def status(self) -> dict:
        if self.exit_code is not None:
            state = {"terminated": self.terminated_state()}
        elif self.started_at and not self.waiting_reason:
            state = {"running": {"startedAt": self.started_at}}
        else:
            state = {"waiting": {"reason": self.waiting_reason or "ContainerCreating",
                                 **({"message": self.waiting_message} if self.waiting_message else {})}}
        out = {"name": self.name, "image": self.image, "imageID": "", "ready": self.ready,
               "restartCount": self.restart_count, "started": state.keys() == {"running"}, "state": state}
        if self.last_terminated:
            out["lastState"] = {"terminated": self.last_terminated}
        return out


def termination_message(lines: list[str], max_bytes: int = TERMINATION_MESSAGE_MAX_BYTES) -> str:
    """The last log lines, trimmed from the front to max_bytes (the end is the useful part)."""
    text = "\n".join(lines)
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    return data[-max_bytes:].decode("utf-8", "ignore")


def pod_phase(restart_policy: str, runs: list[ContainerRun]) -> str:
    """Kubernetes pod phase from its containers (restartPolicy Always/OnFailure keep restarting)."""
    if not runs or any(r.started_at is None and r.exit_code is None for r in runs):
        return "Pending"
    if all(r.exit_code is not None for r in runs):
        if restart_policy == "Always":
            return "Running"  # the agent restarts them
        if all(r.exit_code == 0 for r in runs):
            return "Succeeded"
        if restart_policy == "OnFailure":
            return "Running"
        return "Failed"
    return "Running"


def should_restart(restart_policy: str, exit_code: int) -> bool:
    return restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0)


def restart_delay_s(restart_count: int, base_s: float = 1.0, cap_s: float = 30.0) -> float:
    """The crash-loop backoff of a container (the kubelet uses 10 s doubling to 5 min)."""
    return min(cap_s, base_s * (2 ** max(0, restart_count - 1)))


def _condition(kind: str, ok: bool, now: str, previous: Mapping[str, dict], reason: str | None = None) -> dict:
    status = "True" if ok else "False"
    old = previous.get(kind)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    cond = {"type": kind, "status": status, "lastTransitionTime": since, "lastProbeTime": None}
    if reason and not ok:
        cond["reason"] = reason
    return cond


def pod_status(*, phase: str, pod_ip: str | None, start_time: str | None, runs: list[ContainerRun], now: str,
               previous_conditions: list[dict] | None = None, message: str = "", reason: str = "",
               init_runs: list[ContainerRun] | None = None) -> dict:
    """The full pod status object the agent writes (a merge patch replaces it wholesale)."""
    prev = {c["type"]: c for c in previous_conditions or []}
    initialized = all(r.exit_code == 0 for r in init_runs or [])
    all_ready = bool(runs) and all(r.ready for r in runs) and phase == "Running"
    terminal = phase in ("Succeeded", "Failed")
    conditions = [
        _condition("PodReadyToStartContainers", pod_ip is not None, now, prev),
        _condition("Initialized", initialized, now, prev, "ContainersNotInitialized"),
        _condition("ContainersReady", all_ready, now, prev, "PodCompleted" if terminal else "ContainersNotReady"),
        _condition("Ready", all_ready, now, prev, "PodCompleted" if terminal else "ContainersNotReady"),
        _condition("PodScheduled", True, now, prev),
    ]
    status: dict = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "containerStatuses": [r.status() for r in runs],
        "message": message or None,
        "reason": reason or None,
    }
    if init_runs:
        status["initContainerStatuses"] = [r.status() for r in init_runs]
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if start_time:
        status["startTime"] = start_time
    return status


def node_object(name: str, *, labels: Mapping[str, str] | None = None, cpu: int, memory_bytes: int,
                gpus: int = 0, pods: int = 110) -> dict:
    capacity = {"cpu": str(cpu), "memory": f"{memory_bytes // 1024}Ki", "pods": str(pods)}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                              "rlfleet.io/node-agent": "true", **(labels or {})}},
        "spec": {},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def node_status(*, ready: bool, now: str, since: str, capacity: Mapping[str, str],
                kubelet_port: int | None = None) -> dict:
    """The Node status the agent writes. The API server reaches the agent's log endpoint (`kubectl logs`)
    at the InternalIP address on `daemonEndpoints.kubeletEndpoint.Port`
    (rlfleet.devcluster.node_agent.container_logs)."""
    status = {
        "capacity": dict(capacity),
        "allocatable": dict(capacity),
        "addresses": [{"type": "InternalIP", "address": NODE_ADDRESS}, {"type": "Hostname", "address": "localhost"}],
        "conditions": [{
            "type": "Ready", "status": "True" if ready else "False",
            "reason": "NodeAgentReady" if ready else "NodeAgentStopped",
            "message": "rlfleet node agent " + ("is running pods" if ready else "stopped"),
            "lastHeartbeatTime": now, "lastTransitionTime": since,
        }],
        "nodeInfo": {"kubeletVersion": "rlfleet-node-agent", "operatingSystem": "linux", "architecture": "amd64",
                     "containerRuntimeVersion": "local-process://", "kernelVersion": "", "osImage": "",
                     "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""},
    }
    if kubelet_port is not None:
        status["daemonEndpoints"] = {"kubeletEndpoint": {"Port": kubelet_port}}
    return status


def schedulable_here(pod: dict, node_labels: Mapping[str, str]) -> bool:
    """True when an unbound pod's nodeSelector matches this node (the agent's tiny scheduler)."""
    spec = pod.get("spec", {})
    if spec.get("nodeName") or pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    if spec.get("schedulerName", "default-scheduler") != "default-scheduler":
        return False
    return all(node_labels.get(k) == v for k, v in (spec.get("nodeSelector") or {}).items())


def pod_event(pod: dict, reason: str, message: str, *, node: str, now: str, kind: str = "Warning") -> dict:
    """An Event on the pod from this node, as the kubelet posts one (e.g. a container it cannot create)."""
    meta = pod["metadata"]
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": meta["namespace"],
                           "uid": meta["uid"]},
        "type": kind, "reason": reason, "message": message[:1024],
        "source": {"component": "kubelet", "host": node}, "reportingComponent": "kubelet", "reportingInstance": node,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


def kubeconfig_for_token(server: str, ca_data_b64: str | None, token: str, namespace: str,
                         insecure: bool = False) -> dict:
    cluster: dict = {"server": server}
    if ca_data_b64:
        cluster["certificate-authority-data"] = ca_data_b64
    elif insecure:
        cluster["insecure-skip-tls-verify"] = True
    return {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": "pod", "user": {"token": token}}],
        "contexts": [{"name": "pod", "context": {"cluster": "local", "user": "pod", "namespace": namespace}}],
        "current-context": "pod",
    }
