"""A local node agent: the kubelet's job on one machine, with pods run as local process groups.

    python -m rlfleet.devcluster.node_agent.agent --kubeconfig K --node NAME [--schedule] [--data-dir D]

It registers a Ready Node, watches the pods bound to it (`spec.nodeName`), and runs each pod's
containers as local processes (`rlfleet.util.procs.ManagedProcess`, one process group each). With
`--schedule` it also binds Pending pods that have no node (pods/binding), since the local control
plane has no scheduler. It reports status through the API server like the kubelet: Pending with the
pod's own loopback address as `status.podIP` -> Running, Ready once the httpGet readiness probe passes
-> Succeeded/Failed with each container's exit code and its last log lines as the termination message.
Deleting a pod stops its processes (SIGTERM to the group, SIGKILL after the grace period) and then
removes the pod object. Logs stay in `<data-dir>/logs/<namespace>_<pod>_<uid>/<container>.log`, and
`kubectl logs` reads them through the agent's HTTPS log endpoint (`rlfleet.devcluster.node_agent.log_server`), which
admits only clients with a certificate of the cluster CA (`--client-ca`, default: the kubeconfig's CA).

How a pod spec maps onto local processes (images, addresses, volumes, API access) is documented and
decided in `rlfleet.devcluster.node_agent.plan`; this module does the I/O.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import logging
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import yaml

from rlfleet.devcluster.node_agent import plan
from rlfleet.devcluster.node_agent.container_logs import LogRequestError, log_dir_name
from rlfleet.devcluster.node_agent.log_server import ContainerLogSource, LogServer, server_ssl_context
from rlfleet.devcluster.pki import write_self_signed_serving
from rlfleet.kube.client import (
    CONFIGMAPS,
    EVENTS,
    NODES,
    PODS,
    SECRETS,
    SERVICEACCOUNTS,
    ApiError,
    KubeClient,
    list_and_watch,
)
from rlfleet.util.aio import stop_task
from rlfleet.util.procs import ManagedProcess, mapped_shm_files, sweep_orphaned_shm, tail_file

log = logging.getLogger("rlfleet.node_agent")

HEARTBEAT_S = 20.0
SHM_SCAN_S = 10.0  # how often a container's /dev/shm files are noted (a crashed group can no longer be read)
STOP_GRACE_CAP_S = 30.0
RETRY_S = 2.0


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def exit_code_of(returncode: int) -> int:
    """A container's exit code: killed by signal N reads 128+N, as in a container runtime."""
    return 128 - returncode if returncode < 0 else returncode


def ports_free(ip: str, ports: list[int]) -> bool:
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, port))
            except OSError:
                return False
    return True


class PodWorker:
    """Runs one pod: volumes, address, containers, readiness probes, status, and stop on delete."""

    def __init__(self, agent: NodeAgent, pod: dict):
        self.agent = agent
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.spec: dict = pod.get("spec", {})
        self.restart_policy: str = self.spec.get("restartPolicy", "Always")
        self.runs = [plan.ContainerRun(c["name"], c.get("image", "")) for c in self.spec.get("containers", [])]
        self.init_runs = [plan.ContainerRun(c["name"], c.get("image", ""))
                          for c in self.spec.get("initContainers", [])]
        self.init_failed = False
        self.procs: dict[str, ManagedProcess] = {}
        self.shm_files: set[Path] = set()
        self.pod_ip: str | None = (pod.get("status") or {}).get("podIP")
        self.start_time: str | None = None
        self.log_dir = agent.data_dir / "logs" / log_dir_name(self.namespace, self.name, self.uid)
        self.conditions: list[dict] = list((pod.get("status") or {}).get("conditions") or [])
        self.dirty = asyncio.Event()
        self.deleting = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.started = False
        self.pod_message = ""
        self.pod_reason = ""

    # Lifecycle ------------------------------------------------------------------------------------------
    def update(self, pod: dict) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.deleting.set()

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self._status_writer())
                try:
                    await self._run_pod(tg)
                finally:
                    # Always stop the processes, even when cancelled (shielded so SIGKILL is reaped), and
                    # always release a deleted pod object, even when stopping went wrong.
                    try:
                        await asyncio.shield(self._stop_all())
                    except Exception:
                        log.exception("stopping pod %s/%s", self.namespace, self.name)
                    if self.deleting.is_set():
                        await self._finish_deletion()
                    writer.cancel()
        finally:
            self.agent.release_ip(self.uid)
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, self.agent.data_dir / "pods" / self.uid, True))

    async def _run_pod(self, tg: asyncio.TaskGroup) -> None:
        status = self.pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            await self.deleting.wait()  # finished before the agent (re)started: nothing to run
            return
        self.start_time = status.get("startTime") or now_iso()
        try:
            self.pod_ip = self.agent.take_ip(self.uid, self.pod_ip, self._declared_ports())
            self.mark_dirty()
            plans = await self._plan()
        except plan.PodConfigError as e:
            for r in self.runs:
                r.waiting_reason, r.waiting_message = e.reason, e.message
            self.pod_reason, self.pod_message = e.reason, e.message
            self.mark_dirty()
            log.warning("pod %s/%s cannot start: %s", self.namespace, self.name, e.message)
            await self._warning_event(e.reason, e.message)
            await self.deleting.wait()
            return
        init_plans, plans = plans[:len(self.init_runs)], plans[len(self.init_runs):]
        if not await self._run_init_containers(init_plans):
            self.init_failed = True
            self.mark_dirty()
            await self.deleting.wait()
            return
        self.started = True
        containers = {c["name"]: c for c in self.spec["containers"]}
        for run, cplan in zip(self.runs, plans, strict=True):
            tg.create_task(self._container_loop(run, cplan, containers[run.name]))
        # Terminal pods keep their address and files until the pod object is deleted.
        await self.deleting.wait()

    def _declared_ports(self) -> list[int]:
        return [p["containerPort"] for c in self.spec.get("containers", []) for p in c.get("ports") or []]

    async def _plan(self) -> list[plan.ContainerPlan]:
        data_dir = self.agent.data_dir
        volume_paths = plan.volume_host_paths(self.pod, data_dir, allow_host_path=self.agent.allow_host_path)
        config_data = await self._config_data()
        for vol in self.spec.get("volumes") or []:
            host = volume_paths[vol["name"]]
            await asyncio.to_thread(host.mkdir, parents=True, exist_ok=True)
            if "hostPath" not in vol:  # a link planted in a claim must not lead out of the data dir
                plan.check_resolved(await asyncio.to_thread(host.resolve), data_dir, f"volume {vol['name']!r}")
            for kind, key in (("configmap", "configMap"), ("secret", "secret")):
                if key in vol:
                    ref = vol[key].get("name") or vol[key].get("secretName")
                    files = plan.config_files(host, config_data.get((kind, ref), {}), secret=kind == "secret")
                    await asyncio.to_thread(_write_files, host, files, 0o700 if kind == "secret" else 0o755)
        home = plan.pod_home(data_dir, self.uid)
        await asyncio.to_thread(home.mkdir, mode=0o700, parents=True, exist_ok=True)
        kubeconfig = await self._pod_kubeconfig() if self.spec.get("automountServiceAccountToken", True) else None
        extra_env = plan.runtime_env(pod_name=self.name, home=home, kubeconfig=kubeconfig)
        plans = [
            plan.plan_container(self.pod, c, pod_ip=self.pod_ip or "", node_name=self.agent.node,
                                volume_paths=volume_paths, image_map=self.agent.image_map, extra_env=extra_env,
                                config_data=config_data)
            for c in self.spec.get("initContainers", []) + self.spec["containers"]
        ]
        for cplan in plans:  # mounts through a link planted in a claim (subPath)
            for mount, host in cplan.mounts:
                if host.is_relative_to(data_dir):
                    resolved = await asyncio.to_thread(host.resolve)
                    plan.check_resolved(resolved, data_dir, f"volumeMount {mount!r} of container {cplan.name!r}")
        return plans

    async def _warning_event(self, reason: str, message: str) -> None:
        """A Warning Event on the pod, as the kubelet reports a container it cannot create."""
        try:
            await self.agent.kube.create(EVENTS, plan.pod_event(self.pod, reason, message, node=self.agent.node,
                                                                now=now_iso()), self.namespace)
        except ApiError as e:
            log.warning("event for pod %s/%s: %s", self.namespace, self.name, e)

    async def _run_init_containers(self, plans: list[plan.ContainerPlan]) -> bool:
        """Run init containers one after the other; False when one failed for good (pod Failed)."""
        for run, cplan in zip(self.init_runs, plans, strict=True):
            while True:
                proc = ManagedProcess(f"{self.name}/{run.name}", cplan.argv, env=cplan.env, cwd=cplan.cwd,
                                      log_path=self.log_dir / f"{run.name}.log", inherit_env=False)
                self.procs[run.name] = proc
                await proc.start()
                run.started_at, run.waiting_reason, run.exit_code = now_iso(), None, None
                self.mark_dirty()
                code = exit_code_of(await proc.wait())
                await proc.stop(grace_s=1.0)
                run.exit_code, run.finished_at = code, now_iso()
                run.message = plan.termination_message(tail_file(proc.log_path, plan.TERMINATION_MESSAGE_LINES))
                self.mark_dirty()
                if code == 0:
                    break
                if self.restart_policy == "Never":
                    return False
                run.restart_count += 1
                await asyncio.sleep(plan.restart_delay_s(run.restart_count))
        return True

    async def _config_data(self) -> dict[tuple[str, str], dict[str, str]]:
        """ConfigMaps and Secrets the pod refers to (env or volumes), read once at start."""
        wanted: set[tuple[str, str]] = set()
        for vol in self.spec.get("volumes") or []:
            if "configMap" in vol:
                wanted.add(("configmap", vol["configMap"]["name"]))
            if "secret" in vol:
                wanted.add(("secret", vol["secret"]["secretName"]))
        for c in self.spec.get("containers", []):
            for var in c.get("env") or []:
                src = var.get("valueFrom") or {}
                if "configMapKeyRef" in src:
                    wanted.add(("configmap", src["configMapKeyRef"]["name"]))
                if "secretKeyRef" in src:
                    wanted.add(("secret", src["secretKeyRef"]["name"]))
        data: dict[tuple[str, str], dict[str, str]] = {}
        for kind, name in wanted:
            res = CONFIGMAPS if kind == "configmap" else SECRETS
            try:
                obj = await self.agent.kube.get(res, name, self.namespace)
            except ApiError as e:
                if e.not_found:
                    continue
                raise plan.PodConfigError("CreateContainerConfigError", f"{kind} {name}: {e}") from None
            values = obj.get("data") or {}
            if kind == "secret":
                values = {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in values.items()}
            data[(kind, name)] = values
        return data

    async def _pod_kubeconfig(self) -> Path:
        """A kubeconfig with a token of the pod's own service account (TokenRequest API)."""
        sa = self.spec.get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": 86400,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid}}}
        try:
            answer = await self.agent.kube.create(SERVICEACCOUNTS, body, self.namespace, sub_of=sa, sub="token")
        except ApiError as e:
            raise plan.PodConfigError("CreateContainerConfigError",
                                      f"token for service account {sa!r}: {e}") from None
        cfg = plan.kubeconfig_for_token(self.agent.api_server, self.agent.ca_data_b64, answer["status"]["token"],
                                        self.namespace, insecure=self.agent.ca_data_b64 is None)
        path = self.agent.data_dir / "pods" / self.uid / "kubeconfig"
        await asyncio.to_thread(_write_private, path, yaml.safe_dump(cfg))
        return path

    # Containers -----------------------------------------------------------------------------------------
    def container_names(self) -> set[str]:
        return {r.name for r in self.runs + self.init_runs}

    def container_running(self, name: str) -> bool:
        """True while the container's current process runs (not before its start, nor between restarts)."""
        proc = self.procs.get(name)
        return proc is not None and proc.proc is not None and proc.returncode is None

    async def _container_loop(self, run: plan.ContainerRun, cplan: plan.ContainerPlan, container: dict) -> None:
        while not self.deleting.is_set():
            proc = ManagedProcess(f"{self.name}/{run.name}", cplan.argv, log_path=self.log_dir / f"{run.name}.log",
                                  env=cplan.env, cwd=cplan.cwd, inherit_env=False)
            try:
                await proc.start()
            except OSError as e:
                run.exit_code, run.finished_at, run.message = 128, now_iso(), f"cannot start {cplan.argv[0]}: {e}"
                run.started_at = run.started_at or run.finished_at
                self._on_container_exit(run)
                return
            self.procs[run.name] = proc
            run.started_at, run.exit_code, run.waiting_reason, run.ready = now_iso(), None, None, False
            log.info("pod %s/%s container %s started: pid %s", self.namespace, self.name, run.name, proc.pid)
            probes = plan.container_probes(container, self.pod_ip or "")
            if probes.startup is None and probes.readiness is None:
                run.ready = True
            self.mark_dirty()
            helpers = [asyncio.create_task(self._track_shm(proc))]
            if probes.startup or probes.readiness or probes.liveness:
                helpers.append(asyncio.create_task(self._probe_container(run, proc, probes)))
            try:
                code = exit_code_of(await proc.wait())
            finally:
                for task in helpers:
                    task.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)
            await proc.stop(grace_s=1.0)  # reap children the leader left behind
            await self._remove_shm()
            run.ready = False
            run.exit_code, run.finished_at = code, now_iso()
            run.message = plan.termination_message(tail_file(proc.log_path, plan.TERMINATION_MESSAGE_LINES))
            log.info("pod %s/%s container %s exited with %s", self.namespace, self.name, run.name, code)
            if self.deleting.is_set() or not plan.should_restart(self.restart_policy, code):
                self._on_container_exit(run)
                return
            run.last_terminated = run.terminated_state()
            run.restart_count += 1
            run.exit_code, run.waiting_reason = None, "CrashLoopBackOff"
            run.waiting_message = f"back-off restarting failed container {run.name}"
            self.mark_dirty()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(plan.restart_delay_s(run.restart_count)):
                    await self.deleting.wait()

    def _on_container_exit(self, run: plan.ContainerRun) -> None:
        self.mark_dirty()

    async def _probe_container(self, run: plan.ContainerRun, proc: ManagedProcess, probes: plan.ContainerProbes
                               ) -> None:
        """The kubelet's probes of one running container: startup, then readiness and liveness together.
        A failed startup or liveness probe kills the container (its exit is then handled as any other)."""
        if probes.startup is not None:
            if not await self._passes(probes.startup):
                await self._kill(run, proc, "startup", probes.startup)
                return
            if probes.readiness is None:
                run.ready = True
                self.mark_dirty()
        async with asyncio.TaskGroup() as tg:
            if probes.readiness is not None:
                tg.create_task(self._probe_loop(run, probes.readiness))
            if probes.liveness is not None:
                tg.create_task(self._liveness_loop(run, proc, probes.liveness))

    async def _passes(self, probe: plan.HttpProbe) -> bool:
        """Probe until one success (True) or failureThreshold failures in a row (False)."""
        await asyncio.sleep(probe.initial_delay_s)
        failures = 0
        while True:
            if await self._probe_once(probe):
                return True
            failures += 1
            if failures >= probe.failure_threshold:
                return False
            await asyncio.sleep(probe.period_s)

    async def _liveness_loop(self, run: plan.ContainerRun, proc: ManagedProcess, probe: plan.HttpProbe) -> None:
        await asyncio.sleep(probe.initial_delay_s)
        failures = 0
        while True:
            failures = 0 if await self._probe_once(probe) else failures + 1
            if failures >= probe.failure_threshold:
                await self._kill(run, proc, "liveness", probe)
                return
            await asyncio.sleep(probe.period_s)

    async def _kill(self, run: plan.ContainerRun, proc: ManagedProcess, what: str, probe: plan.HttpProbe) -> None:
        """Stop a container that failed its `what` probe, within the pod's grace period (the kubelet's way)."""
        log.warning("pod %s/%s container %s failed its %s probe %s %d times: killing it", self.namespace, self.name,
                    run.name, what, probe.url, probe.failure_threshold)
        run.ready = False
        self.mark_dirty()
        grace = min(float(self.spec.get("terminationGracePeriodSeconds", 30)), STOP_GRACE_CAP_S)
        await proc.stop(grace_s=max(grace, 0.5))

    async def _probe_loop(self, run: plan.ContainerRun, probe: plan.HttpProbe) -> None:
        await asyncio.sleep(probe.initial_delay_s)
        successes = failures = 0
        while True:
            ok = await self._probe_once(probe)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            ready = run.ready
            if ok and successes >= probe.success_threshold:
                ready = True
            elif not ok and failures >= probe.failure_threshold:
                ready = False
            if ready != run.ready:
                run.ready = ready
                log.info("pod %s/%s container %s ready=%s", self.namespace, self.name, run.name, ready)
                self.mark_dirty()
            await asyncio.sleep(probe.period_s)

    async def _track_shm(self, proc: ManagedProcess) -> None:
        """Note the shared-memory files the container maps: in a real pod /dev/shm dies with the pod."""
        while proc.pid is not None:
            self.shm_files |= await asyncio.to_thread(mapped_shm_files, proc.pid)
            await asyncio.sleep(SHM_SCAN_S)

    async def _remove_shm(self) -> None:
        paths, self.shm_files = list(self.shm_files), set()  # taken on the loop: the tracker adds to the set
        await asyncio.to_thread(_unlink_all, paths)

    async def _probe_once(self, probe: plan.HttpProbe) -> bool:
        try:
            async with self.agent.http.get(probe.url, timeout=aiohttp.ClientTimeout(total=probe.timeout_s)) as r:
                return 200 <= r.status < 400
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _stop_all(self) -> None:
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        grace_s = min(float(grace if grace is not None else self.spec.get("terminationGracePeriodSeconds", 30)),
                      STOP_GRACE_CAP_S)
        procs = [p for p in self.procs.values() if p.proc is not None]
        for p in procs:
            if p.returncode is None and p.pid is not None:
                self.shm_files |= await asyncio.to_thread(mapped_shm_files, p.pid)
        await asyncio.gather(*(p.stop(grace_s=max(grace_s, 0.5)) for p in procs), return_exceptions=True)
        await self._remove_shm()

    async def _finish_deletion(self) -> None:
        """After the processes are gone: remove the pod object (grace 0, this uid only) and its files."""
        for _ in range(5):
            try:
                await self.agent.kube.delete(PODS, self.name, self.namespace, grace_period_s=0, uid=self.uid)
                break
            except ApiError as e:
                log.warning("deleting pod %s/%s: %s", self.namespace, self.name, e)
                await asyncio.sleep(RETRY_S)

    # Status ---------------------------------------------------------------------------------------------
    def mark_dirty(self) -> None:
        self.dirty.set()

    def status(self) -> dict:
        phase = plan.pod_phase(self.restart_policy, self.runs) if self.started else "Pending"
        if self.init_failed:
            phase = "Failed"
        return plan.pod_status(phase=phase, pod_ip=self.pod_ip, start_time=self.start_time, runs=self.runs,
                               now=now_iso(), previous_conditions=self.conditions, message=self.pod_message,
                               reason=self.pod_reason, init_runs=self.init_runs)

    async def _status_writer(self) -> None:
        """Write the latest status whenever it changed; one write at a time, retried on failure."""
        last: dict | None = None
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            status = self.status()
            if status == last:
                continue
            try:
                await self.agent.kube.merge_patch(PODS, self.name, {"status": status}, self.namespace, sub="status")
                self.conditions = status["conditions"]
                last = status
            except ApiError as e:
                if e.not_found:
                    return
                log.warning("status of pod %s/%s: %s", self.namespace, self.name, e)
                await asyncio.sleep(RETRY_S)
                self.dirty.set()


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _write_files(directory: Path, files: list[tuple[Path, str, int]], dir_mode: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(dir_mode)
    for path, text, mode in files:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # never write through a link; the mode is set at creation
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, mode)  # the umask may have taken bits away


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


class NodeAgent:
    """One node: registration, the pod watch, the optional binder, and one PodWorker per pod."""

    def __init__(self, kube: KubeClient, node: str, data_dir: Path, *, schedule: bool = False,
                 image_map: plan.ImageMap | None = None, pod_network: str = "127.0.0.0/24", first_host: int = 10,
                 gpus: int = 0, labels: dict[str, str] | None = None, client_ca_pem: str | None = None,
                 allow_host_path: bool = False):
        self.kube = kube
        self.allow_host_path = allow_host_path
        self.node = node
        self.data_dir = Path(data_dir).resolve()
        self.schedule = schedule
        self.image_map = image_map or plan.ImageMap()
        self.ip_pool = plan.PodIpPool(pod_network, first_host)
        self.gpus = gpus
        self.labels = dict(labels or {})
        self.workers: dict[str, PodWorker] = {}
        self.http: aiohttp.ClientSession
        cfg = kube.api.configuration
        assert cfg.host is not None, "the API client has no server address"
        self.api_server: str = cfg.host
        self.ca_data_b64: str | None = None
        api_ca_pem: str | None = None
        if cfg.ssl_ca_cert:
            api_ca_pem = Path(cfg.ssl_ca_cert).read_text()
            self.ca_data_b64 = base64.b64encode(api_ca_pem.encode()).decode()
        # Whose client certificates may read pod logs: the cluster CA, which signs the API server's.
        self.client_ca_pem = client_ca_pem or api_ca_pem
        self.log_server: LogServer | None = None
        self.log_port: int | None = None
        self._ready_since: str | None = None
        self.ready = asyncio.Event()  # set once the node is registered and the first pod list is handled

    # Addresses ------------------------------------------------------------------------------------------
    def take_ip(self, uid: str, preferred: str | None, ports: list[int]) -> str:
        unusable: set[str] = set()
        while True:
            ip = self.ip_pool.take(uid, preferred, unusable)
            if ports_free(ip, ports):
                return ip
            self.ip_pool.release(uid)  # somebody else's process listens there: skip that address
            unusable.add(ip)
            preferred = None

    def release_ip(self, uid: str) -> None:
        self.ip_pool.release(uid)

    # Main -----------------------------------------------------------------------------------------------
    async def run(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        removed = await asyncio.to_thread(sweep_orphaned_shm)  # a killed agent's engine pods left them
        if removed:
            log.info("removed %d file(s) that killed engine pods left in /dev/shm", len(removed))
        async with aiohttp.ClientSession() as self.http:
            try:
                await self._start_log_server()
                await self._register()
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._heartbeat())
                    tg.create_task(self._watch_own_pods())
                    if self.schedule:
                        tg.create_task(self._bind_unscheduled())
            finally:
                await asyncio.shield(self._shutdown())
                if self.log_server:
                    await asyncio.shield(self.log_server.stop())

    # Container logs (kubectl logs) ----------------------------------------------------------------------
    async def _start_log_server(self) -> None:
        if not self.client_ca_pem:
            log.warning("no CA to check clients against (kubeconfig without certificate-authority and no "
                        "--client-ca): container logs are not served, `kubectl logs` will fail")
            return
        cert, key = await asyncio.to_thread(write_self_signed_serving, self.data_dir / "pki",
                                            f"{self.node}-node-agent", (plan.NODE_ADDRESS,))
        context = server_ssl_context(cert, key, self.client_ca_pem)
        self.log_server = LogServer(self.log_source, context, plan.NODE_ADDRESS)
        self.log_port = await self.log_server.start()

    def log_source(self, namespace: str, pod: str, container: str) -> ContainerLogSource:
        """The log of a container of a pod on this node; LogRequestError(404) when there is none."""
        workers = [w for w in self.workers.values() if w.namespace == namespace and w.name == pod]
        if not workers:
            raise LogRequestError(404, f"pod {namespace}/{pod} is not on node {self.node}")
        worker = next((w for w in workers if not w.deleting.is_set()), workers[0])  # a replacement wins
        if container not in worker.container_names():
            raise LogRequestError(404, f"container {container!r} is not in pod {namespace}/{pod} "
                                       f"(it has {sorted(worker.container_names())})")
        return ContainerLogSource(worker.log_dir / f"{container}.log", lambda: worker.container_running(container))

    async def _shutdown(self) -> None:
        workers = list(self.workers.values())
        for w in workers:
            if w.task:
                w.task.cancel()
        await asyncio.gather(*(w.task for w in workers if w.task), return_exceptions=True)
        if self._ready_since is None:
            return  # never registered
        with contextlib.suppress(ApiError):
            await self._write_node_status(ready=False)

    async def _register(self) -> None:
        capacity = plan.node_object(self.node, cpu=os.cpu_count() or 1, memory_bytes=_memory_bytes(),
                                    gpus=self.gpus, labels=self.labels)
        self.node_labels = capacity["metadata"]["labels"]
        self._capacity = capacity["status"]["capacity"]
        try:
            await self.kube.create(NODES, capacity)
        except ApiError as e:
            if not e.conflict:
                raise
            await self.kube.merge_patch(NODES, self.node, {"metadata": {"labels": self.node_labels}})
        self._ready_since = now_iso()
        await self._write_node_status(ready=True)
        log.info("node %s registered", self.node)

    async def _write_node_status(self, *, ready: bool) -> None:
        assert self._ready_since is not None, "the node status is written only once registered"
        status = plan.node_status(ready=ready, now=now_iso(), since=self._ready_since, capacity=self._capacity,
                                  kubelet_port=self.log_port)
        await self.kube.merge_patch(NODES, self.node, {"status": status}, sub="status")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._write_node_status(ready=True)
            except ApiError as e:
                log.warning("node heartbeat: %s", e)

    async def _watch_own_pods(self) -> None:
        selector = f"spec.nodeName={self.node}"
        await self._list_and_watch(selector, self._on_own_pods_listed, self._on_own_pod_event)

    async def _bind_unscheduled(self) -> None:
        await self._list_and_watch("spec.nodeName=", self._on_unbound_listed, self._on_unbound_event)

    async def _list_and_watch(self, field_selector: str, on_list, on_event) -> None:
        await list_and_watch(self.kube, PODS, on_list, on_event, field_selector=field_selector, retry_s=RETRY_S,
                             on_error=lambda e: log.warning("pod watch (%s): %s", field_selector, e))

    async def _on_own_pods_listed(self, pods: list[dict]) -> None:
        seen = set()
        for pod in pods:
            seen.add(pod["metadata"]["uid"])
            await self._on_own_pod_event("MODIFIED", pod)
        for uid in set(self.workers) - seen:  # deleted while we were not watching
            self._forget(uid)
        self.ready.set()

    async def _on_own_pod_event(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if kind == "DELETED":
            if worker:
                self._forget(uid)
            return
        if worker is None:
            if pod["metadata"].get("deletionTimestamp") and not (pod.get("status") or {}).get("startTime"):
                # Never started here: nothing to stop, just let it go.
                with contextlib.suppress(ApiError):
                    await self.kube.delete(PODS, pod["metadata"]["name"], pod["metadata"]["namespace"],
                                           grace_period_s=0, uid=uid)
                return
            worker = PodWorker(self, pod)
            self.workers[uid] = worker
            worker.task = asyncio.create_task(self._run_worker(worker), name=f"pod-{pod['metadata']['name']}")
        worker.update(pod)

    async def _run_worker(self, worker: PodWorker) -> None:
        try:
            await worker.run()
        except* Exception as eg:  # one pod's failure must not take the agent down
            log.error("pod %s/%s worker failed: %r", worker.namespace, worker.name, eg.exceptions)
        finally:
            self.workers.pop(worker.uid, None)

    def _forget(self, uid: str) -> None:
        """The pod object is gone: stop its processes without touching the API object."""
        worker = self.workers.get(uid)
        if worker and worker.task:
            worker.deleting.clear()
            worker.task.cancel()

    async def _on_unbound_listed(self, pods: list[dict]) -> None:
        for pod in pods:
            await self._on_unbound_event("ADDED", pod)

    async def _on_unbound_event(self, kind: str, pod: dict) -> None:
        if kind == "DELETED" or not plan.schedulable_here(pod, self.node_labels):
            return
        meta = pod["metadata"]
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}}
        try:
            await self.kube.create(PODS, binding, meta["namespace"], sub_of=meta["name"], sub="binding")
            log.info("bound pod %s/%s to %s", meta["namespace"], meta["name"], self.node)
        except ApiError as e:
            if not (e.conflict or e.not_found):
                log.warning("binding pod %s/%s: %s", meta["namespace"], meta["name"], e)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlfleet.devcluster.node_agent.agent",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", required=True, help="kubeconfig of the API server (node credentials)")
    p.add_argument("--node", required=True, help="name of the Node object to register")
    p.add_argument("--data-dir", default=None, help="pod volumes and logs (default: ./.node-agent/<node>)")
    p.add_argument("--schedule", action="store_true", help="also bind Pending pods that have no node")
    p.add_argument("--pod-network", default="127.0.0.0/24", help="loopback network for pod addresses")
    p.add_argument("--first-host", type=int, default=10, help="first host number handed out in --pod-network")
    p.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu capacity to advertise")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="extra node label (repeatable)")
    p.add_argument("--client-ca", default=None, metavar="FILE",
                   help="CA (PEM) whose client certificates may read container logs; default: the kubeconfig's "
                        "certificate authority, which signs the API server's kubelet client certificate")
    p.add_argument("--allow-host-path", action="store_true",
                   help="map hostPath volumes to their host path (default: pods with one are refused)")
    p.add_argument("--image-map", default=None, help='JSON file {"image-pattern": {"word": ["argv", ...]}}')
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    for item in args.label:
        if "=" not in item:
            p.error(f"--label {item!r}: expected K=V")
    return args


async def amain(args: argparse.Namespace) -> int:
    image_map = (plan.ImageMap.from_json(await asyncio.to_thread(Path(args.image_map).read_text))
                 if args.image_map else plan.ImageMap())
    data_dir = Path(args.data_dir or Path(".node-agent") / args.node)
    labels = dict(item.split("=", 1) for item in args.label)
    client_ca_pem = await asyncio.to_thread(Path(args.client_ca).read_text) if args.client_ca else None
    async with await KubeClient.load(args.kubeconfig) as kube:
        agent = NodeAgent(kube, args.node, data_dir, schedule=args.schedule, image_map=image_map,
                          pod_network=args.pod_network, first_host=args.first_host, gpus=args.gpus, labels=labels,
                          client_ca_pem=client_ca_pem, allow_host_path=args.allow_host_path)
        task = asyncio.create_task(agent.run())
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        signalled = asyncio.create_task(stopping.wait())
        try:
            await asyncio.wait((task, signalled), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await stop_task(signalled)
            await stop_task(task)  # a signal stops the agent; an error it ended with is raised
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        return asyncio.run(amain(args))
    except (ApiError, plan.PodConfigError, ValueError, OSError) as e:
        print(f"node agent: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
