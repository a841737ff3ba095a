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
    (["--kubernetes", "--namespace", "ns", "--training-run", "r", "--snapshot-dir", "/s", "--resume"],
     "--resume runs locally only for now"),
])
def test_usage_errors_exit_2_and_say_what_is_missing(argv, message, capsys, monkeypatch):
    for var in ("POD_NAMESPACE", "RLFLEET_TRAINING_RUN", "RLFLEET_SNAPSHOT_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
