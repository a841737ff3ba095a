"""Keys and tokens never leave a log file: the one redaction function and the places that copy log tails."""
from __future__ import annotations

import pytest

from rlfleet.kube.conditions import condition
from rlfleet.kube.pods import pod_failure
from rlfleet.orchestrator.run.summary import RunSummary
from rlfleet.util.procs import tail_file
from rlfleet.util.redact import redact

SERVER_ARGS = ("server_args=ServerArgs(model_path='/m', api_key='sk-live-123', admin_api_key=None, "
               "max_total_tokens=8192, port=30000)")


@pytest.mark.parametrize("line, secret, kept", [
    (SERVER_ARGS, "sk-live-123", ["api_key='***'", "admin_api_key=None", "max_total_tokens=8192", "port=30000"]),
    ("python3 -m sglang.launch_server --api-key sk-123 --port 1 --model-path /x", "sk-123",
     ["--api-key ***", "--port 1", "--model-path /x"]),
    ("launch_router --api-key=rk-9 --host 0.0.0.0", "rk-9", ["--api-key=***", "--host 0.0.0.0"]),
    ("curl -H 'Authorization: Bearer eyJhbGciOi.xyz' http://h", "eyJhbGciOi.xyz", ["Authorization: Bearer ***"]),
    ('{"api_key": "abc123", "max_new_tokens": 5}', "abc123", ['"api_key": "***"', '"max_new_tokens": 5']),
    ("env: HF_TOKEN=hf_abcdef WANDB_API_KEY=zzz9 PATH=/usr/bin", "hf_abcdef", ["HF_TOKEN=***", "PATH=/usr/bin"]),
    ("token=t0k3n, secret: s3cr3t; password='pw1234'", "t0k3n", ["token=***", "secret: ***", "password='***'"]),
])
def test_redact_masks_values_and_keeps_the_rest(line, secret, kept):
    out = redact(line)
    assert secret not in out
    for part in kept:
        assert part in out, out


def test_redact_masks_known_values_wherever_they_are():
    assert redact("connecting with hunter2-xyz now", ["hunter2-xyz"]) == "connecting with *** now"
    assert redact("nothing to hide: ValueError at step 3") == "nothing to hide: ValueError at step 3"


def test_local_log_tails_are_redacted(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("starting\n" + SERVER_ARGS + "\nRuntimeError: boom\n")
    tail = tail_file(log, 5)
    assert "sk-live-123" not in "\n".join(tail) and tail[-1] == "RuntimeError: boom"


def test_pod_failures_conditions_and_the_summary_are_redacted():
    pod = {"metadata": {"name": "p", "annotations": {}},
           "status": {"phase": "Failed", "containerStatuses": [
               {"name": "engine", "state": {"terminated": {"exitCode": 1, "message": SERVER_ARGS + "\nboom"}}}]}}
    failure = pod_failure(pod)
    assert failure is not None and "sk-live-123" not in failure.message and "boom" in failure.message
    cond = condition("Failed", True, "EngineCrashLoop", "last lines:\n--api-key sk-123", now=0.0, previous=None)
    assert "sk-123" not in cond["message"] and "--api-key ***" in cond["message"]
    summary = RunSummary(steps_planned=1, failure="RolloutEnginesUnavailable: " + SERVER_ARGS)
    assert "sk-live-123" not in summary.to_dict()["failure"]


def test_the_routers_control_plane_keys_are_redacted():
    line = ("sglang::router --api-key abc123 --control-plane-api-keys rlfleet:rlfleet:admin:abc123 "
            "--max-total-tokens 4096")
    out = redact(line)
    assert "abc123" not in out and "--max-total-tokens 4096" in out
