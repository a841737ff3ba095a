"""The dev cluster's node agent: its command line, Node readiness, node names, and the CLI flags."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.devcluster.cli import build_parser
from rlfleet.devcluster.node import node_agent_argv, node_is_ready, node_name_error
from rlfleet.devcluster.node_agent.agent import parse_args as parse_node_agent_args


def test_the_agent_accepts_its_command_line() -> None:
    argv = node_agent_argv(python="/py", kubeconfig=Path("/c/admin.kubeconfig"), node="local",
                           data_dir=Path("/c/node"), first_host=200)
    assert argv[:4] == ["/py", "-P", "-m", "rlfleet.devcluster.node_agent.agent"]
    args = parse_node_agent_args(argv[4:])
    assert (args.kubeconfig, args.node, args.data_dir) == ("/c/admin.kubeconfig", "local", "/c/node")
    assert args.schedule is True  # the local control plane has no scheduler
    assert args.first_host == 200


def test_without_first_host_the_agent_keeps_its_default() -> None:
    argv = node_agent_argv(python="/py", kubeconfig=Path("/k"), node="n1", data_dir=Path("/d"))
    assert "--first-host" not in argv
    default = parse_node_agent_args(["--kubeconfig", "/k", "--node", "n1"]).first_host
    assert parse_node_agent_args(argv[4:]).first_host == default


@pytest.mark.parametrize(("node", "ready"), [
    (None, False),
    ({}, False),
    ({"status": {}}, False),
    ({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, False),
    ({"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}, False),
    ({"status": {"conditions": [{"type": "MemoryPressure", "status": "True"}]}}, False),
    ({"status": {"conditions": [{"type": "MemoryPressure", "status": "False"},
                                {"type": "Ready", "status": "True"}]}}, True),
])
def test_node_is_ready_reads_the_ready_condition(node: dict | None, ready: bool) -> None:
    assert node_is_ready(node) is ready


@pytest.mark.parametrize("name", ["local", "node-1", "a", "gpu.node-2.example", "0"])
def test_valid_node_names(name: str) -> None:
    assert node_name_error(name) is None


@pytest.mark.parametrize("name", ["", "Local", "my_node", "-node", "node-", "a..b", "x" * 254, "node/1"])
def test_invalid_node_names_say_why(name: str) -> None:
    error = node_name_error(name)
    assert error is not None and repr(name) in error and "lower-case" in error


def test_up_starts_a_node_agent_by_default() -> None:
    args = build_parser().parse_args(["up"])
    assert (args.node_agent, args.node, args.first_host) == (True, "local", None)


def test_up_flags_for_the_node_agent() -> None:
    args = build_parser().parse_args(["up", "--no-node-agent", "--node", "n2", "--first-host", "50"])
    assert (args.node_agent, args.node, args.first_host) == (False, "n2", 50)
