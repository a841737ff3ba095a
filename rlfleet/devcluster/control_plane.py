"""A local Kubernetes control plane on loopback, without Docker: etcd, kube-apiserver, kube-controller-manager.

Used by `rlfleet dev-cluster` and by the e2e test fixture (same code). The API server runs with RBAC and
service-account token signing, so RBAC rules can be tested with real ServiceAccount tokens. Every
process runs in its own process group on free ports of 127.0.0.1, so several clusters can run at once.

The controller manager runs only what the operator's behaviour depends on:
- garbage-collector-controller: ownerReferences cascade (deleting a TrainingRun deletes its fleets/pods);
- namespace-controller: deleting a namespace deletes its contents;
- serviceaccount-controller: creates the `default` ServiceAccount of each namespace, which the
  ServiceAccount admission plugin (kept on, as in real clusters) requires before it admits any pod;
- root-ca-certificate-publisher-controller: the kube-root-ca.crt ConfigMap that pod token volumes use;
- deployment-controller, replicaset-controller: each fleet's router is a Deployment;
- persistentvolumeclaim-protection-controller: lifts the in-use protection of a deleted claim once no
  pod uses it (without it a run's snapshot claim is never garbage-collected).
Tokens themselves need no controller: the API server signs them (TokenRequest, `kubectl create token`).
"""
from __future__ import annotations

import base64
import contextlib
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlfleet.devcluster.pki import ControlPlanePki, write_control_plane_pki
from rlfleet.util.binaries import tool_path
from rlfleet.util.ports import free_port
from rlfleet.util.procs import GroupProcess

CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "deployment-controller",
    "replicaset-controller",
    "persistentvolumeclaim-protection-controller",
)
SERVICE_CIDR = "10.0.0.0/24"
HOST = "127.0.0.1"
PORT_ATTEMPTS = 3  # a free port can be taken between choosing it and binding it
KUBECTL_TIMEOUT_S = 60.0


class ControlPlaneError(RuntimeError):
    """The control plane failed to start; the message quotes the failing component's log."""


class _PortTaken(Exception):
    pass


@dataclass(frozen=True)
class ComponentState:
    name: str
    pid: int
    log: str


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) in data_dir; `start()`, then `stop()`."""

    def __init__(self, data_dir: Path, with_controller_manager: bool = True, keep: bool = False):
        self.data_dir = Path(data_dir)
        self.with_controller_manager = with_controller_manager
        self.keep = keep
        self.kubeconfig = self.data_dir / "admin.kubeconfig"
        self.server = ""
        self.etcd_url = ""
        self.pki: ControlPlanePki | None = None
        self.processes: list[GroupProcess] = []

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 90.0) -> ControlPlane:
        """Start every component and wait until the API server is ready (bounded by timeout)."""
        binaries = {name: tool_path(name) for name in self._binaries()}  # MissingTool before anything runs
        deadline = time.monotonic() + timeout
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.pki = write_control_plane_pki(self.data_dir / "pki")
        try:
            for attempt in range(PORT_ATTEMPTS):
                try:
                    self._start_components(binaries, deadline)
                    return self
                except _PortTaken:
                    self._stop_processes()
                    if attempt == PORT_ATTEMPTS - 1:
                        raise ControlPlaneError(
                            "could not bind free ports after retries (another process took them)") from None
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, keep: bool | None = None) -> None:
        """Stop every process group (controller manager, API server, etcd); remove data_dir unless keep."""
        self._stop_processes()
        if not (self.keep if keep is None else keep):
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def components(self) -> list[ComponentState]:
        return [ComponentState(p.name, p.pid, str(p.log_path)) for p in self.processes if p.pid is not None]

    def failed_component(self) -> GroupProcess | None:
        """The first component whose process has exited, if any."""
        return next((p for p in self.processes if p.returncode is not None), None)

    # ---- clients ---------------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, kubeconfig: Path | None = None,
                timeout: float = KUBECTL_TIMEOUT_S) -> subprocess.CompletedProcess:
        """Run the pinned kubectl against this cluster (admin unless kubeconfig is given)."""
        argv = [str(tool_path("kubectl")), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def service_account_kubeconfig(self, namespace: str, name: str, duration: str = "24h") -> Path:
        """A kubeconfig that authenticates as ServiceAccount namespace/name with a TokenRequest token.

        Creates the namespace and the ServiceAccount when missing; grants nothing.
        """
        manifest = yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
        ])
        self.kubectl("apply", "-f", "-", input=manifest)
        token = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").stdout.strip()
        path = self.data_dir / f"sa-{namespace}-{name}.kubeconfig"
        _write_kubeconfig(path, server=self.server, ca_cert=self._pki().ca_cert,
                          user=f"system:serviceaccount:{namespace}:{name}", credentials={"token": token},
                          namespace=namespace)
        return path

    # ---- internals -------------------------------------------------------------------------------

    def _binaries(self) -> list[str]:
        names = ["etcd", "kube-apiserver"]
        if self.with_controller_manager:
            names.append("kube-controller-manager")
        return names

    def _pki(self) -> ControlPlanePki:
        assert self.pki is not None, "the control plane was not started"
        return self.pki

    def _start_components(self, binaries: dict[str, Path], deadline: float) -> None:
        pki = self._pki()
        logs = self.data_dir / "logs"
        etcd_port, peer_port, api_port = free_port(HOST), free_port(HOST), free_port(HOST)
        self.etcd_url = f"http://{HOST}:{etcd_port}"
        peer_url = f"http://{HOST}:{peer_port}"
        etcd_dir = self.data_dir / "etcd"
        shutil.rmtree(etcd_dir, ignore_errors=True)
        etcd = self._spawn("etcd", [
            str(binaries["etcd"]),
            "--name=default", f"--data-dir={etcd_dir}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--unsafe-no-fsync=true",  # throwaway data: durability costs seconds per write on slow disks
            "--log-level=warn",
        ], logs)
        self._wait_ready(etcd, f"{self.etcd_url}/health", deadline)

        self.server = f"https://{HOST}:{api_port}"
        apiserver = self._spawn("kube-apiserver", [
            str(binaries["kube-apiserver"]),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={HOST}", f"--advertise-address={HOST}", f"--secure-port={api_port}",
            f"--cert-dir={self.data_dir / 'apiserver'}",
            f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={self.server}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            # Loopback only: no `kubernetes` Service endpoints pointing at this machine's address.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            # `kubectl logs` is proxied to the node agent's log endpoint (the kubelet's /containerLogs) at the
            # Node's InternalIP, authenticated with this client certificate. No --kubelet-certificate-authority:
            # the agent has no CA key, so its serving certificate is self-signed and is not verified.
            f"--kubelet-client-certificate={pki.kubelet_client_cert}",
            f"--kubelet-client-key={pki.kubelet_client_key}",
            "--kubelet-preferred-address-types=InternalIP",
        ], logs)
        self._wait_ready(apiserver, f"{self.server}/readyz", deadline, tls=True)
        _write_kubeconfig(self.kubeconfig, server=self.server, ca_cert=pki.ca_cert, user="admin",
                          credentials={"client-certificate-data": _b64(pki.admin_cert),
                                       "client-key-data": _b64(pki.admin_key)})

        if self.with_controller_manager:
            cm_port = free_port(HOST)
            manager = self._spawn("kube-controller-manager", [
                str(binaries["kube-controller-manager"]),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                f"--bind-address={HOST}", f"--secure-port={cm_port}",
                f"--cert-dir={self.data_dir / 'controller-manager'}",
                f"--controllers={','.join(CONTROLLERS)}",
                f"--root-ca-file={pki.ca_cert}",
                "--leader-elect=false",
                "--kube-api-qps=100", "--kube-api-burst=200",
            ], logs)
            self._wait_ready(manager, f"https://{HOST}:{cm_port}/healthz", deadline, tls=True, verify=False)

    def _spawn(self, name: str, argv: list[str], logs: Path) -> GroupProcess:
        process = GroupProcess(name, argv, log_path=logs / f"{name}.log", cwd=str(self.data_dir))
        process.start()
        self.processes.append(process)
        return process

    def _wait_ready(self, process: GroupProcess, url: str, deadline: float, *, tls: bool = False,
                    verify: bool = True) -> None:
        context = self._ssl_context(verify) if tls else None
        last = "no answer yet"
        while True:
            if process.returncode is not None:
                tail = process.tail(25)
                if any("address already in use" in line for line in tail):
                    raise _PortTaken(process.name)
                raise ControlPlaneError(failure_message(process,
                                                        f"exited with code {process.returncode} during start-up"))
            try:
                with urllib.request.urlopen(url, timeout=2.0, context=context) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                last = str(getattr(exc, "reason", exc))
            if time.monotonic() >= deadline:
                raise ControlPlaneError(failure_message(process, f"was not ready at {url} in time (last: {last})"))
            time.sleep(0.25)

    def _ssl_context(self, verify: bool) -> ssl.SSLContext:
        pki = self._pki()
        if not verify:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            return context
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        return context

    def _stop_processes(self) -> None:
        # Reverse start order: clients first, etcd last.
        for process in reversed(self.processes):
            with contextlib.suppress(Exception):
                process.stop(grace_s=10.0)
        self.processes = []


def failure_message(process: GroupProcess, what: str) -> str:
    """What went wrong with a component, where its log is, and the log's last lines."""
    tail = "\n".join("    " + line for line in process.tail(25)) or "    (empty log)"
    return f"{process.name} {what}; log {process.log_path}, last lines:\n{tail}"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _write_kubeconfig(path: Path, *, server: str, ca_cert: Path, user: str, credentials: dict[str, str],
                      namespace: str | None = None) -> None:
    context: dict[str, str] = {"cluster": "rlfleet-dev", "user": user}
    if namespace:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "rlfleet-dev",
                      "cluster": {"server": server, "certificate-authority-data": _b64(ca_cert)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "rlfleet-dev", "context": context}],
        "current-context": "rlfleet-dev",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
