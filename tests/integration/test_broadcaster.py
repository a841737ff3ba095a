"""The broadcasting rank 0 in its own process, against a real gloo peer created as SGLang creates its
side of the update group (`init_custom_process_group`): bytes arrive intact; rank 0 listens on exactly
the address it is given (store and gloo); a peer that never joins or stops mid-broadcast costs the
bound, kills the process, and leaves the caller free. A group's build cancelled while its rank 0 starts
leaves neither the process nor its shared buffer behind."""
from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlfleet.orchestrator.fleet import broadcast_plan as plan
from rlfleet.orchestrator.fleet.broadcaster import Broadcaster, BroadcastError
from rlfleet.orchestrator.fleet.update_group import UpdateGroup
from rlfleet.util.ports import free_port

pytestmark = [pytest.mark.engines, pytest.mark.asyncio(loop_scope="session")]

PEER = r"""
import hashlib, sys, torch, torch.distributed as dist
from sglang.srt.utils.common import init_custom_process_group
port, nbytes, address = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
group = init_custom_process_group(backend="gloo", init_method=f"tcp://{address}:{port}", world_size=2, rank=1,
                                  group_name="test-group")
print("joined", flush=True)
data = torch.empty(nbytes, dtype=torch.uint8)
dist.broadcast(data, src=0, group=group)
print(hashlib.sha256(data.numpy().tobytes()).hexdigest(), flush=True)
"""


def start_peer(port: int, nbytes: int, address: str = "127.0.0.1") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, str(port), str(nbytes), address], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)


def listening_addresses(pid: int) -> set[str]:
    """The local addresses (host:port) that process `pid` listens on, from `ss` (which touches no socket)."""
    out = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3] for line in out.splitlines() if f"pid={pid}," in line}


async def broadcast_and_check(broadcaster: Broadcaster, peer: subprocess.Popen, nbytes: int) -> None:
    """Broadcast random bytes; the peer prints the sha256 of what it received."""
    payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    broadcaster.buffer.copy_(payload)
    await broadcaster.broadcast(0, nbytes, timeout_s=60)
    out, _ = await asyncio.to_thread(peer.communicate, timeout=60)
    assert out.split()[-1] == hashlib.sha256(payload.numpy().tobytes()).hexdigest()


async def test_bytes_arrive_intact_at_an_sglang_style_peer():
    nbytes = 3 * 1024**2 + 5
    port = free_port()
    broadcaster = Broadcaster(nbytes)
    await broadcaster.start()
    peer = await asyncio.to_thread(start_peer, port, nbytes)
    try:
        await broadcaster.join(address="127.0.0.1", port=port, world_size=2, group_name="test-group", backend="gloo",
                               timeout_s=120)
        await broadcast_and_check(broadcaster, peer, nbytes)
    finally:
        await broadcaster.close()
        if peer.poll() is None:
            os.killpg(peer.pid, signal.SIGKILL)
    assert not broadcaster.alive


async def test_rank_zero_listens_on_exactly_its_address_store_and_gloo():
    """As on a node whose pods share the host's network: any other address would be another pod's."""
    address, nbytes, port = "127.0.0.77", 1024**2, free_port()
    broadcaster = Broadcaster(nbytes)
    await broadcaster.start()
    peer = await asyncio.to_thread(start_peer, port, nbytes, address)
    try:
        await broadcaster.join(address=address, port=port, world_size=2, group_name="test-group", backend="gloo",
                               timeout_s=120)
        assert broadcaster._proc is not None
        listening = listening_addresses(broadcaster._proc.pid)
        assert f"{address}:{port}" in listening  # the store, on the update group's port
        assert len(listening) >= 2, listening  # and gloo's own listener, on a port the kernel picked
        assert {a.rsplit(":", 1)[0] for a in listening} == {address}, listening
        await broadcast_and_check(broadcaster, peer, nbytes)
    finally:
        await broadcaster.close()
        if peer.poll() is None:
            os.killpg(peer.pid, signal.SIGKILL)


async def test_a_peer_that_never_joins_costs_the_bound_and_kills_rank_zero():
    broadcaster = Broadcaster(1024)
    await broadcaster.start()
    started = time.monotonic()
    with pytest.raises(BroadcastError, match="join"):
        await broadcaster.join(address="127.0.0.1", port=free_port(), world_size=2, group_name="g", backend="gloo",
                               timeout_s=3)
    took = time.monotonic() - started
    await broadcaster.close()
    assert took < 3 + 5 + 2  # the join bound plus the answer's grace
    assert not broadcaster.alive


async def test_a_peer_stopped_mid_broadcast_costs_the_bound_and_kills_rank_zero():
    nbytes = 256 * 1024**2  # far more than the sockets buffer: the send blocks on the stopped peer
    port = free_port()
    broadcaster = Broadcaster(nbytes)
    await broadcaster.start()
    peer = await asyncio.to_thread(start_peer, port, nbytes)
    try:
        await broadcaster.join(address="127.0.0.1", port=port, world_size=2, group_name="test-group", backend="gloo",
                               timeout_s=120)
        assert (await asyncio.to_thread(peer.stdout.readline)).strip() == "joined"
        os.killpg(peer.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(BroadcastError, match="did not finish within 3.0 s"):
            await broadcaster.broadcast(0, nbytes, timeout_s=3)
        assert time.monotonic() - started < 3 + 5  # the bound, plus killing rank 0 on a loaded machine
        await broadcaster.close()
        assert not broadcaster.alive
    finally:
        os.killpg(peer.pid, signal.SIGKILL)
        await broadcaster.close()


def broadcasting_processes() -> list[int]:
    """This process's children that run a broadcasting rank 0 (not zombies)."""
    found = []
    for task in os.listdir("/proc/self/task"):
        try:  # a thread may end meanwhile
            children = Path(f"/proc/self/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                stat = Path(f"/proc/{child}/stat").read_text()
            except OSError:
                continue
            if b"rlfleet.orchestrator.fleet.broadcaster" in cmdline and stat[stat.rindex(")") + 2] != "Z":
                found.append(int(child))
    return found


def weight_buffers() -> list[str]:
    """This process's descriptors of a broadcast's shared buffer (a memfd)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:rlfleet-weights"):
            found.append(target)
    return found


async def test_a_build_cancelled_while_rank_zero_starts_leaves_neither_it_nor_its_buffer():
    buckets = plan.plan_buckets([plan.TensorSpec("t", "float32", (1024,), 4096)], 4096)
    assert not weight_buffers()
    build = asyncio.ensure_future(UpdateGroup.build([], buckets=buckets, bounds=plan.StepBounds(60.0),
                                                    client=lambda url: None, address="127.0.0.1",  # type: ignore[arg-type,return-value]
                                                    backend="gloo", group_name="cancelled"))
    deadline = time.monotonic() + 30
    while not broadcasting_processes():  # rank 0 runs: it answers once torch is imported, seconds later
        assert time.monotonic() < deadline and not build.done(), "no broadcasting process started"
        await asyncio.sleep(0.02)
    assert weight_buffers()
    build.cancel()
    with pytest.raises(asyncio.CancelledError):
        await build
    assert not broadcasting_processes()
    assert not weight_buffers()
