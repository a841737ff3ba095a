"""The operator runs from its own dependencies alone: an environment built from requirements-operator.lock
(no torch, SGLang or transformers; `scripts/operator-venv.sh`, cached under ~/.cache/rlfleet/ by the lock's
hash) runs `python -m rlfleet.operator` against the real API server, and one reconcile of the quickstart
creates the run's children: the fleets, their router Deployments, the trainer pod and the snapshot claim.

Real kube-apiserver + etcd + kube-controller-manager (`control_plane`), the chart installed with helm, the
operator with the chart's ServiceAccount token. No node agent: no pod runs (no engines).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from helpers.cluster import (
    OPERATOR_SA,
    REPO,
    SYSTEM_NS,
    OperatorProcess,
    apply,
    chart_installed,
    get_json,
    wait_for,
)
from rlfleet.crds import conventions as c
from rlfleet.crds.derive import snapshot_claim_name
from rlfleet.crds.models import TrainingRunSpec

pytestmark = [pytest.mark.cluster]

NS = "rlfleet-opimage"
RUN = "quickstart"


@pytest.fixture(scope="module")
def operator_python() -> Path:
    """The operator's environment (built once per version of the lock: pip, about 15 s; then cached)."""
    out = subprocess.run([str(REPO / "scripts" / "operator-venv.sh")], capture_output=True, text=True,
                         timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    python = Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"
    assert python.is_file(), out.stdout
    return python


@pytest.fixture(scope="module")
def package_path(tmp_path_factory) -> Path:
    """A directory holding only the checkout's `rlfleet` package (what `pip install --no-deps .` installs)."""
    root = tmp_path_factory.mktemp("operator-package")
    (root / "rlfleet").symlink_to(REPO / "rlfleet", target_is_directory=True)
    return root


def test_the_operator_environment_has_none_of_the_trainers_packages(operator_python, package_path):
    for module in ("torch", "sglang", "transformers", "megatron", "safetensors", "numpy"):
        probe = subprocess.run([str(operator_python), "-P", "-c", f"import {module}"], capture_output=True, text=True,
                               timeout=60, env={"PYTHONPATH": str(package_path), "PATH": "/usr/bin:/bin"})
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, (module, probe.stderr)


def test_the_engine_follower_runs_from_the_operators_environment(operator_python, package_path):
    """A fleet of no run's router pod runs `rlfleet follow-engines` from the operator's image."""
    probe = subprocess.run([str(operator_python), "-P", "-m", "rlfleet.cli", "follow-engines", "--help"],
                           capture_output=True, text=True, timeout=60,
                           env={"PYTHONPATH": str(package_path), "PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0 and "--fleet-uid" in probe.stdout, probe.stderr


def test_the_operator_from_its_own_environment_reconciles_the_quickstart(control_plane, operator_python,
                                                                         package_path, tmp_path):
    cp = control_plane
    with chart_installed(cp, NS):
        kubeconfig = cp.service_account_kubeconfig(SYSTEM_NS, OPERATOR_SA)
        op = OperatorProcess(kubeconfig, NS, tmp_path, python=str(operator_python),
                             env={"PYTHONPATH": str(package_path), "PYTHONNOUSERSITE": "1"})
        op.start()
        try:
            manifest = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
            manifest["metadata"]["namespace"] = NS
            apply(cp, manifest)
            run = get_json(cp, "trainingrun", RUN, namespace=NS)
            run_uid = run["metadata"]["uid"]
            spec = TrainingRunSpec.model_validate(run["spec"])

            def owned(kind: str, name: str, owner_uid: str) -> dict | None:
                obj = get_json(cp, kind, name, namespace=NS)
                refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
                return obj if any(r["uid"] == owner_uid and r.get("controller") for r in refs) else None

            children = {}
            for kind, name in (("rolloutfleet", c.rollout_fleet_name(RUN)), ("evalfleet", c.eval_fleet_name(RUN)),
                               ("pod", c.trainer_pod_name(RUN)),
                               ("persistentvolumeclaim", snapshot_claim_name(RUN, spec))):
                children[kind] = wait_for(lambda kind=kind, name=name: owned(kind, name, run_uid), timeout=90,
                                          interval=0.5, what=f"{kind} {name} owned by the run", context=op.tail)
            for fleet_kind in ("rolloutfleet", "evalfleet"):
                fleet = children[fleet_kind]
                router = c.router_name(fleet["metadata"]["name"])
                wait_for(lambda router=router, fleet=fleet: owned("deployment", router, fleet["metadata"]["uid"]),
                         timeout=90, interval=0.5, what=f"router Deployment {router}", context=op.tail)
            # The trainer pod runs the trainer image (torch and all), not the operator's.
            trainer = children["pod"]["spec"]["containers"][0]
            assert trainer["image"] == c.DEFAULT_RLFLEET_IMAGE
            assert op.alive(), op.tail()
        finally:
            cp.kubectl("delete", "trainingrun", RUN, "-n", NS, "--ignore-not-found", "--wait=false", check=False)
            op.stop()
        log = "\n".join(op.process.tail(400)) if op.process else ""
        assert "Traceback" not in log, log[-3000:]
