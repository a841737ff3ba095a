"""CPU engines run as local processes start through rlfleet.sglang.forked_server (SGLang's server with
forked, not spawned, processes); pods and CUDA engines keep `sglang.launch_server`."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rlfleet.crds.specs import EngineSpec
from rlfleet.sglang.forked_server import device_of
from rlfleet.sglang.launch import build_engine_launch

CPU = EngineSpec(model_path="/m", device="cpu")
CUDA = EngineSpec(model_path="/m", device="cuda")


def test_local_cpu_engines_fork_and_everything_else_launches_sglang_itself():
    assert build_engine_launch(CPU, host="h", forked_cpu_processes=True).args[:2] == (
        "-m", "rlfleet.sglang.forked_server")
    assert build_engine_launch(CPU, host="h").args[:2] == ("-m", "sglang.launch_server")  # pods
    assert build_engine_launch(CUDA, host="h", forked_cpu_processes=True).args[:2] == ("-m", "sglang.launch_server")
    forked = build_engine_launch(CPU, host="h", forked_cpu_processes=True).args[2:]
    assert forked == build_engine_launch(CPU, host="h").args[2:]  # the same flags


@pytest.mark.parametrize(("argv", "device"), [
    (["--model-path", "/m", "--device", "cpu"], "cpu"),
    (["--device=cuda", "--port", "1"], "cuda"),
    (["--model-path", "/m"], None),
    (["--device"], None),
])
def test_device_of_reads_both_spellings(argv, device):
    assert device_of(argv) == device


def test_a_non_cpu_engine_is_refused_before_sglang_is_imported():
    done = subprocess.run([sys.executable, "-m", "rlfleet.sglang.forked_server", "--model-path", "/m",
                           "--device", "cuda"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "CPU engines only (--device cpu), not cuda" in done.stderr
