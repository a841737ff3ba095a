"""Rank 0 of a weight-update group, in a process of its own, so a broadcast can always be abandoned.

A collective that a peer has left blocks its caller (gloo's rendezvous waited minutes for a rank that
never came). The trainer never calls one: the `Broadcaster` process does, on weights the trainer copies
into a shared memory buffer (a memfd both processes map), and the orchestrator bounds every command it
sends. A command that does not answer in time kills the process: the group dies with it and nothing in
the trainer waits. The process also dies with its parent (PR_SET_PDEATHSIG).

Commands (one JSON line each on stdin, one JSON line answered on stdout):
  {"op": "join", "address", "port", "world_size", "group_name", "backend", "timeout_s"} -> the group exists
  {"op": "broadcast", "start", "end"}: broadcast bytes [start, end) of the buffer from rank 0
  {"op": "exit"}
The group is created as SGLang creates it on the engines (`init_custom_process_group`: a TCP store
rendezvous under the group's name, then a process group of exactly those ranks); a plain
`init_process_group` on the same address would rendezvous with nothing.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # importing torch in a fresh interpreter on a loaded machine
EXIT_TIMEOUT_S = 5.0


class BroadcastError(Exception):
    """The broadcasting process failed, timed out or could not start."""


def check_listen_address(address: str, port: int) -> None:
    """Raise BroadcastError at once when this machine cannot listen on address:port (a wrong address
    would leave every engine connecting to nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((address, port))
    except OSError as exc:
        raise BroadcastError(f"cannot listen on {address}:{port} for the update group: {exc}") from exc


class Broadcaster:
    """The parent's handle of one broadcasting process and its shared buffer."""

    def __init__(self, nbytes: int, *, device: str = "cpu", python: str | None = None):
        self.nbytes = max(1, nbytes)
        self.device = device
        self.python = python or sys.executable
        self._fd: int | None = None
        self.buffer: Any = None  # torch uint8 tensor over the shared memory
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        import torch

        fd = os.memfd_create("rlfleet-weights", 0)
        self._fd = fd
        os.ftruncate(fd, self.nbytes)
        self.buffer = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=self.nbytes, dtype=torch.uint8)
        self._proc = await asyncio.create_subprocess_exec(
            self.python, "-P", "-m", "rlfleet.orchestrator.fleet.broadcaster", str(fd), str(self.nbytes), self.device,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, pass_fds=(fd,), start_new_session=True)
        await self._command({"op": "hello"}, START_TIMEOUT_S)

    def views(self, buckets) -> dict[str, Any]:
        """Each tensor of `buckets` as a view of its place in the buffer (name -> tensor of its dtype and
        shape): a trainer that exports into these leaves `fill` nothing to copy."""
        import torch

        assert self.buffer is not None, "Broadcaster not started"
        views: dict[str, Any] = {}
        for bucket in buckets:
            offset = bucket.start  # a bucket holds one dtype and starts 64-byte aligned: views line up
            for spec in bucket.tensors:
                part = self.buffer[offset:offset + spec.nbytes]
                views[spec.name] = part.view(getattr(torch, spec.dtype)).view(spec.shape)
                offset += spec.nbytes
        return views

    def fill(self, buckets, tensors) -> None:
        """Copy each bucket's tensors into the buffer (blocking: call it in a thread); a tensor that
        already is its place in the buffer (exported into `views`) is not copied."""
        import torch

        assert self.buffer is not None, "Broadcaster not started"
        base = self.buffer.data_ptr()
        for bucket in buckets:
            offset = bucket.start
            for spec in bucket.tensors:
                src = tensors[spec.name].detach()
                in_place = src.device.type == "cpu" and src.is_contiguous() and src.data_ptr() == base + offset
                if not in_place:
                    flat = src.contiguous().reshape(-1).view(torch.uint8)
                    self.buffer[offset:offset + spec.nbytes].copy_(flat.cpu())
                offset += spec.nbytes

    async def join(self, *, address: str, port: int, world_size: int, group_name: str, backend: str,
                   timeout_s: float) -> None:
        await self._command({"op": "join", "address": address, "port": port, "world_size": world_size,
                             "group_name": group_name, "backend": backend, "timeout_s": timeout_s}, timeout_s + 5)

    async def broadcast(self, start: int, end: int, timeout_s: float) -> float:
        answer = await self._command({"op": "broadcast", "start": start, "end": end, "timeout_s": timeout_s},
                                     timeout_s)
        return float(answer.get("seconds", 0.0))

    async def _command(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        proc = self._proc
        if proc is None or proc.returncode is not None or proc.stdin is None or proc.stdout is None:
            raise BroadcastError("the broadcasting process is not running")
        try:
            async with asyncio.timeout(timeout_s):
                proc.stdin.write((json.dumps(message) + "\n").encode())
                await proc.stdin.drain()
                while True:  # a library may print on stdout: answers are the JSON lines with "ok"
                    line = await proc.stdout.readline()
                    if not line or line.startswith(b'{"ok"'):
                        break
        except TimeoutError:
            self.kill()
            raise BroadcastError(f"{message['op']} did not finish within {timeout_s:.1f} s") from None
        except (ConnectionError, BrokenPipeError) as exc:
            self.kill()
            raise BroadcastError(f"{message['op']}: the broadcasting process is gone ({exc})") from exc
        if not line:
            self.kill()
            raise BroadcastError(f"{message['op']}: the broadcasting process exited")
        answer = json.loads(line)
        if not answer.get("ok"):
            self.kill()
            raise BroadcastError(f"{message['op']} failed: {answer.get('error')}")
        return answer

    def kill(self) -> None:
        """Abandon the group at once (the process and every collective in it die)."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        """Leave the group: ask the process to exit, kill it if it does not; release the buffer."""
        proc = self._proc
        try:
            if proc is not None and proc.returncode is None:
                try:
                    await self._command({"op": "exit"}, EXIT_TIMEOUT_S)
                except BroadcastError:
                    pass
                self.kill()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(EXIT_TIMEOUT_S):
                        await proc.wait()
        finally:
            self.buffer = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# --- the broadcasting process ----------------------------------------------------------------------

def _die_with_parent() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _listening_socket(address: str, port: int) -> socket.socket:
    """A socket listening on exactly address:port (a TCP store of its own would listen on every address,
    colliding with any other pod's on a node whose pods share the host's network, as the dev cluster's)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(128)
    return sock


# Gloo of rank 0 on exactly the pod IP. torch's public ways to place gloo are GLOO_SOCKET_IFNAME (an
# interface: gloo takes that interface's first IPv4 address) and the address the hostname resolves to;
# on a node whose pods share one interface and hostname (the dev cluster's 127.0.0.N, any hostNetwork
# pod) neither is the pod IP. A device for an address (`ProcessGroupGloo.create_device(hostname=...)`,
# public) reaches a group only through ProcessGroupGloo's options constructor, whose options type is
# `ProcessGroupGloo._Options` (the `Options` the stubs name is Backend.Options at run time), and
# `new_group`/`init_process_group` ignore pg options for gloo. So rank 0 registers a backend of its own
# through the public `Backend.register_backend`, whose creator builds that group; torch's own "gloo"
# stays as it is. On the wire it is plain gloo: same store keys ("cpu/" under the group's prefix), same
# pairs, so SGLang's gloo ranks meet it.
GLOO_ON_ADDRESS = "rlfleet_gloo_on_address"


def _create_gloo_on_address(opts, address):
    """The creator of GLOO_ON_ADDRESS: a gloo group whose one device binds `address` (the group's
    backend options, as `_new_process_group_helper(backend_options=...)` passes them)."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = opts.timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    pg = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)
    pg.options.global_ranks_in_group = opts.global_ranks_in_group
    pg.options.group_name = opts.group_id
    return pg


def _register_gloo_on_address() -> None:
    from torch.distributed import Backend

    Backend.register_backend(GLOO_ON_ADDRESS, _create_gloo_on_address, extended_api=True, devices=["cpu"])


def _custom_group(backend: str, address: str, port: int, world_size: int, group_name: str, timeout_s: float):
    """SGLang's `init_custom_process_group` (sglang/srt/utils/common.py) for rank 0, its store and (gloo)
    its connections on `address`."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = timedelta(seconds=timeout_s)
    listener = _listening_socket(address, port)
    try:
        # As rendezvous("tcp://...") makes it for rank 0, but on the socket above.
        store = TCPStore(address, port, world_size, True, timeout=timeout, wait_for_workers=False,
                         multi_tenant=True, master_listen_fd=listener.detach(), use_libuv=True)
    except BaseException:
        listener.close()
        raise
    store.set_timeout(timeout)
    options: object = None
    if backend == "gloo":
        _register_gloo_on_address()
        backend, options = GLOO_ON_ADDRESS, address
    rank = 0
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name,  # type: ignore[arg-type]  # a str, as SGLang passes it
                                      backend_options=options, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _main(argv: list[str]) -> int:
    _die_with_parent()
    fd, nbytes, device = int(argv[0]), int(argv[1]), argv[2]
    import torch
    import torch.distributed as dist

    buffer = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    group = None
    out = sys.stdout

    def answer(**body: Any) -> None:
        out.write(json.dumps(body) + "\n")
        out.flush()

    for line in sys.stdin:
        message = json.loads(line)
        op = message.get("op")
        try:
            if op == "hello":
                answer(ok=True)
            elif op == "join":
                group = _custom_group(message["backend"], message["address"], int(message["port"]),
                                      int(message["world_size"]), message["group_name"], float(message["timeout_s"]))
                answer(ok=True)
            elif op == "broadcast":
                assert group is not None, "broadcast before join"
                started = time.monotonic()
                data = buffer[int(message["start"]):int(message["end"])]
                if device != "cpu":
                    data = data.to(device)
                dist.broadcast(data, group=group, group_src=0)
                if device != "cpu":
                    torch.cuda.synchronize()
                answer(ok=True, seconds=time.monotonic() - started)
            elif op == "exit":
                if group is not None:
                    with contextlib.suppress(Exception):
                        dist.destroy_process_group(group)
                answer(ok=True)
                return 0
            else:
                answer(ok=False, error=f"unknown op {op!r}")
        except Exception as exc:  # reported to the parent, which kills this process
            answer(ok=False, error=f"{type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
