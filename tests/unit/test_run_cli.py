"""`rlfleet run` refuses incomplete command lines before it touches anything."""
import pytest

from rlfleet.orchestrator.run.cli import main


@pytest.mark.parametrize("argv, message", [
    ([], "give a TrainingRun FILE (or --kubernetes inside a cluster)"),
    (["--kubernetes", "run.yaml", "--namespace", "ns", "--training-run", "r", "--snapshot-dir", "/s"],
     "--kubernetes reads the TrainingRun from the API server; give no FILE"),
    (["--kubernetes", "--snapshot-dir", "/s"], "--kubernetes needs --namespace, --training-run"),
    (["--kubernetes", "--namespace", "ns", "--training-run", "r"], "--kubernetes needs --snapshot-dir"),
    (["examples/quickstart.yaml", "--steps", "0"], "--steps must be >= 1"),
    (["examples/quickstart.yaml", "--resume"], "--resume: examples/quickstart.yaml has no spec.checkpoint"),
])
def test_usage_errors_exit_2_and_say_what_is_missing(argv, message, capsys, monkeypatch):
    for var in ("POD_NAMESPACE", "RLFLEET_TRAINING_RUN", "RLFLEET_SNAPSHOT_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_local_run_refuses_env_from_secrets_naming_the_field(tmp_path, capsys):
    manifest = tmp_path / "run.yaml"
    manifest.write_text(
        "apiVersion: rlfleet.io/v1alpha1\nkind: TrainingRun\nmetadata: {name: t}\nspec:\n"
        "  modelPath: tiny://llama\n"
        "  trainer: {env: [{name: A, value: x}, {name: HF_TOKEN, valueFrom: {secretKeyRef: {name: hf, key: token}}}]}\n"
        "  rollout: {engine: {env: [{name: C, valueFrom: {configMapKeyRef: {name: cm, key: c}}}]}}\n"
    )
    assert main([str(manifest), "--run-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot run locally" in err
    assert "spec.trainer.env[1].valueFrom: valueFrom (secretKeyRef, configMapKeyRef) needs the Kubernetes" in err
    assert "spec.rollout.engine.env[0].valueFrom" in err
    assert not (tmp_path / "out").exists()  # refused before anything started


WANDB_RUN = ("apiVersion: rlfleet.io/v1alpha1\nkind: TrainingRun\nmetadata: {name: t}\nspec:\n"
             "  modelPath: tiny://llama\n  tracking: {wandb: {project: p%s}}\n")


def test_a_local_run_refuses_the_wandb_key_from_a_secret_naming_the_field(tmp_path, capsys):
    manifest = tmp_path / "run.yaml"
    manifest.write_text(WANDB_RUN % ", apiKey: {secretKeyRef: {name: wandb, key: api-key}}")
    assert main([str(manifest), "--run-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot run locally" in err and "spec.tracking.wandb.apiKey: a Secret needs the Kubernetes API server" in err
    assert not (tmp_path / "out").exists()


def test_wandb_configured_without_the_package_fails_at_load_naming_the_field(tmp_path):
    """The CLI in a process whose import path lacks the directory wandb is installed in."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    spec = importlib.util.find_spec("wandb")
    assert spec is not None and spec.origin is not None
    site = str(Path(spec.origin).parents[1])
    if importlib.util.find_spec("pydantic").origin.startswith(site):  # type: ignore[union-attr]
        pytest.skip("wandb is installed beside rlfleet's own requirements here (one site directory)")
    manifest = tmp_path / "run.yaml"
    manifest.write_text(WANDB_RUN % ", mode: offline")
    code = (f"import sys; sys.path.remove({site!r}); from rlfleet.orchestrator.run.cli import main; "
            f"sys.exit(main([{str(manifest)!r}, '--run-dir', {str(tmp_path / 'out')!r}]))")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "cannot run here" in done.stderr and "spec.tracking.wandb: the wandb package is not installed" in done.stderr
    assert not (tmp_path / "out").exists()
