"""A trainer group's launchers (one per node) meet in a static rendezvous on node 0's address.

Two real launcher processes (torch.distributed's elastic agent), each starting 2 real gloo ranks of a
world of 4, on two loopback addresses of this machine as two nodes: global ranks follow torchrun's
node-rank rule (node x 2 + local rank), all 4 ranks form one process group (an all-reduce sums 0..3),
node 0's store listens on exactly its address, and a rank that dies on node 1 is named by its launcher.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.util.ports import free_port

TESTS = Path(__file__).resolve().parents[1]
ADDRESS = "127.0.0.57"


def start(node: int, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.Popen([sys.executable, "-P", "-m", "helpers.node_launch", str(node), ADDRESS, str(port), *extra],
                            cwd=TESTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def answer(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(lines[-1])


def listeners(port: int) -> set[str]:
    out = subprocess.run(["ss", "-Htln", f"sport = :{port}"], capture_output=True, text=True).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}


@pytest.mark.timeout(600)
def test_two_nodes_of_two_ranks_form_one_world_with_torchruns_node_ranks():
    port = free_port(ADDRESS)
    follower = start(1, port)  # before node 0: it waits for node 0's store
    time.sleep(1)
    leader = start(0, port)
    seen: set[str] = set()
    while leader.poll() is None and not seen:
        seen = listeners(port)
        time.sleep(0.05)
    by_node = [answer(leader), answer(follower)]
    ranks = {int(k): v for node in by_node for k, v in node["results"].items()}
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, got in ranks.items():
        assert (got["node"], got["local"]) == divmod(rank, 2) and got["world"] == 4
        assert got["sum"] == 6.0 and got["master"] == ADDRESS
    assert sorted(by_node[0]["results"]) == ["0", "1"] and sorted(by_node[1]["results"]) == ["2", "3"]
    assert seen == {ADDRESS}, seen  # node 0's store: on its own address only, not on every address


@pytest.mark.timeout(600)
def test_a_rank_that_dies_on_node_1_is_named_by_its_launcher():
    port = free_port(ADDRESS)
    leader, follower = start(0, port, "3"), start(1, port, "3")
    failed = answer(follower)
    assert failed["failed"] == 3 and failed["exitcode"] == 3, failed
    assert "trainer rank 3 exited with 3" in failed["message"] and "rank 3 fails on purpose" in failed["message"]
    leader.terminate()  # its launcher stops its ranks (they would wait out their collective's timeout)
    leader.communicate(timeout=120)
