"""spec.trainer.env in a local run: the trainer's process (and its ranks) get the variables, the engines
and routers it starts get the environment `rlfleet run` was started with."""
from __future__ import annotations

import os
import sys

from rlfleet.util.procs import OUTER_ENV, ManagedProcess, outer_environment, set_trainer_environment


def test_outer_environment_restores_what_the_trainers_variables_replaced():
    environ = {"PATH": "/bin", "NCCL_DEBUG": "INFO", "HF_HOME": "/trainer-hf",
               OUTER_ENV: '{"NCCL_DEBUG": null, "HF_HOME": "/shell-hf"}'}
    assert outer_environment(environ) == {"PATH": "/bin", "HF_HOME": "/shell-hf"}
    assert outer_environment({"PATH": "/bin"}) == {"PATH": "/bin"}


async def test_a_started_process_sees_the_environment_from_before_the_trainers(monkeypatch, tmp_path):
    for name in (OUTER_ENV, "RLFLEET_TEST_SET", "RLFLEET_TEST_NEW"):  # each restored after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("RLFLEET_TEST_SET", "shell")
    set_trainer_environment({"RLFLEET_TEST_SET": "trainer", "RLFLEET_TEST_NEW": "trainer"})
    assert os.environ["RLFLEET_TEST_SET"] == os.environ["RLFLEET_TEST_NEW"] == "trainer"
    # A rank process inherits the variables and the record: setting them again changes nothing.
    set_trainer_environment({"RLFLEET_TEST_SET": "again"})
    assert os.environ["RLFLEET_TEST_SET"] == "trainer"

    probe = "import os; print(os.environ.get('RLFLEET_TEST_SET'), os.environ.get('RLFLEET_TEST_NEW'))"
    child = ManagedProcess("probe", [sys.executable, "-c", probe], log_path=tmp_path / "probe.log")
    await child.start()
    assert await child.wait() == 0
    assert (tmp_path / "probe.log").read_text().split() == ["shell", "None"]
