"""The node agent's container-log endpoint: the kubelet's `GET /containerLogs/{ns}/{pod}/{container}` over HTTPS.

kube-apiserver proxies `kubectl logs` here (rules and parameters: `rlfleet.devcluster.node_agent.container_logs`). It
runs on the agent's own event loop (aiohttp); file reads go to a worker thread one bounded block at a time.

Who may read: the TLS handshake requires a client certificate signed by the cluster CA (kube-apiserver's
`--kubelet-client-certificate`), so no other local user or process can read pod logs through it.
Serving certificate: self-signed, made at start (the agent has the CA certificate but not its key), so the
API server runs without `--kubelet-certificate-authority` and does not verify it, as with a kubelet whose
serving certificate is self-signed. The endpoint listens on the Node's InternalIP only (loopback).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from rlfleet.devcluster.node_agent.container_logs import (
    READ_BLOCK,
    FollowStep,
    LogRequest,
    LogRequestError,
    clip_to_limit,
    follow_step,
    parse_log_request,
    tail_start,
)

log = logging.getLogger("rlfleet.node_agent.logs")

FOLLOW_POLL_S = 0.25  # how often a follower looks for new output
SHUTDOWN_S = 2.0  # open followers get this long when the agent stops


@dataclass(frozen=True)
class ContainerLogSource:
    """Where a container's log is, and whether its process runs now (a follower stops once it does not)."""

    path: Path
    running: Callable[[], bool]


# (namespace, pod, container) -> the container's log; raises LogRequestError(404) for unknown ones.
Resolver = Callable[[str, str, str], ContainerLogSource]


def server_ssl_context(cert: Path, key: Path, client_ca_pem: str) -> ssl.SSLContext:
    """TLS that admits only clients whose certificate the given CA signed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    context.load_verify_locations(cadata=client_ca_pem)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _find_start(path: Path, tail_lines: int | None) -> tuple[int, int]:
    """(offset to start at, file size now); FileNotFoundError when the container never started."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if tail_lines is None:
            return 0, size
        return tail_start(size, lambda offset, length: os.pread(fd, length, offset), tail_lines), size
    finally:
        os.close(fd)


def _read_block(path: Path, offset: int, length: int) -> bytes:
    # Opened for each read: a cancelled read leaves nothing open (the log is append-only, never rotated).
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


class LogServer:
    """`port = await start()`, then `await stop()`."""

    def __init__(self, resolve: Resolver, ssl_context: ssl.SSLContext, host: str):
        self.resolve = resolve
        self.ssl_context = ssl_context
        self.host = host
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application()
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._container_logs)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))  # a free port, chosen by the kernel and held from here on
            site = web.SockSite(runner, sock, ssl_context=self.ssl_context)
            await site.start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = sock.getsockname()[1]
        log.info("container logs served on https://%s:%d", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _container_logs(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        try:
            req = parse_log_request(info["namespace"], info["pod"], info["container"], request.query)
            source = self.resolve(req.namespace, req.pod, req.container)
            try:
                start, size = await asyncio.to_thread(_find_start, source.path, req.tail_lines)
            except FileNotFoundError:
                raise LogRequestError(400, f"container {req.container!r} in pod {req.namespace}/{req.pod} "
                                           "is waiting to start") from None
        except LogRequestError as e:
            return web.Response(status=e.status, text=e.message + "\n")
        response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
        await response.prepare(request)
        try:
            await self._stream(request, response, req, source, start, None if req.follow else size)
        except ConnectionResetError:
            pass  # the client went away
        return response

    async def _stream(self, request: web.Request, response: web.StreamResponse, req: LogRequest,
                      source: ContainerLogSource, offset: int, end: int | None) -> None:
        """Send the log from offset: up to end, or (follow, end None) until the container's process ended."""
        sent = 0
        while end is None or offset < end:
            running = end is None and source.running()  # checked before the read (see follow_step)
            length = READ_BLOCK if end is None else min(READ_BLOCK, end - offset)
            chunk = await asyncio.to_thread(_read_block, source.path, offset, length)
            step = follow_step(len(chunk), running)
            if step is FollowStep.END:
                return
            if step is FollowStep.WAIT:
                transport = request.transport
                if transport is None or transport.is_closing():
                    return  # the client went away while nothing was written
                await asyncio.sleep(FOLLOW_POLL_S)
                continue
            offset += len(chunk)
            out = clip_to_limit(chunk, sent, req.limit_bytes)
            await response.write(out)
            sent += len(out)
            if req.limit_bytes is not None and sent >= req.limit_bytes:
                return
