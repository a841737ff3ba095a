"""The health-probe client: its HTTP/1.x answer parser (pure) and its connection handling over real
loopback sockets.

The tiny servers here only produce socket-level outcomes (kept-alive answers, closed idle connections,
silence, refusals, chunked bodies, garbage). Real SGLang is covered by the integration tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from aiohttp import web

from helpers.http_app import serving
from rlfleet.sglang.errors import (
    BadResponse,
    CallTimeout,
    ClientErrorStatus,
    ConnectionClosed,
    ConnectionRefused,
    ServerErrorStatus,
    ServiceUnavailable,
)
from rlfleet.sglang.probe import HealthProbeClient, IncompleteAnswer, ResponseParser

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nserver: uvicorn\r\n\r\n"


async def until(condition, timeout_s: float = 5.0) -> None:
    """Until `condition()` holds: a state the client and server reach through the loop's timers, which a
    loaded machine may fire late (a fixed sleep could wake first)."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - plain counters, no event to wait on
            await asyncio.sleep(0.01)


# --- the parser ----------------------------------------------------------------------------------

def test_a_complete_answer_in_one_piece():
    answer = ResponseParser().feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nDate: x\r\n\r\nok")
    assert (answer.status, answer.body, answer.keep_alive) == (200, b"ok", True)


def test_an_answer_fed_byte_by_byte():
    data = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\nbusy!"
    parser = ResponseParser()
    results = [parser.feed(data[i:i + 1]) for i in range(len(data))]
    assert results[:-1] == [None] * (len(data) - 1)
    assert (results[-1].status, results[-1].body) == (503, b"busy!")


def test_a_chunked_body_split_anywhere():
    data = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
    for cut in range(1, len(data)):
        parser = ResponseParser()
        assert parser.feed(data[:cut]) is None
        answer = parser.feed(data[cut:])
        assert answer is not None and answer.body == b"hello world", cut


def test_a_body_until_close_and_connection_semantics():
    parser = ResponseParser()
    assert parser.feed(b"HTTP/1.0 200 OK\r\n\r\nall of it") is None
    answer = parser.feed_eof()
    assert answer.body == b"all of it" and not answer.keep_alive
    assert not ResponseParser().feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n").keep_alive
    assert ResponseParser().feed(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n").keep_alive
    assert ResponseParser().feed(b"HTTP/1.1 204 No Content\r\n\r\n").body == b""


@pytest.mark.parametrize("data", [
    b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nextra",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n",
])
def test_garbage_is_a_bad_response(data):
    with pytest.raises(BadResponse):
        ResponseParser().feed(data)


def test_an_answer_cut_short_is_incomplete():
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(IncompleteAnswer, match="before the response was complete"):
        parser.feed_eof()
    with pytest.raises(IncompleteAnswer, match="without a response"):
        ResponseParser().feed_eof()


# --- the client over loopback sockets ------------------------------------------------------------

class RawServer:
    """A TCP server whose per-request behaviour is scripted: each request gets `answer(n)`, where
    n counts requests over the server's life; None closes the connection without answering, "hang"
    never answers. With `idle_close_s`, connections idle that long are closed (a keep-alive timeout)."""

    def __init__(self, answer, idle_close_s: float | None = None):
        self.answer = answer
        self.idle_close_s = idle_close_s
        self.requests = 0
        self.connections = 0
        self.closed_by_client = 0
        self.closed_idle = 0
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def crash(self) -> None:
        """Like a process that died: the port stops listening and every connection closes."""
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.add(writer)
        try:
            while True:
                try:
                    async with asyncio.timeout(self.idle_close_s):
                        head = await reader.readuntil(b"\r\n\r\n")
                except TimeoutError:
                    self.closed_idle += 1
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_client += 1
                    return
                self.requests += 1
                self.last_request = head
                reply = self.answer(self.requests)
                if reply is None:
                    return
                if reply == "hang":
                    if await reader.read(1) == b"":
                        self.closed_by_client += 1
                    return
                writer.write(reply)
                await writer.drain()
        finally:
            self.writers.discard(writer)
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)


@pytest.fixture
async def raw_server():
    servers: list[RawServer] = []

    async def start(answer, **kwargs) -> tuple[RawServer, str]:
        server = RawServer(answer, **kwargs)
        servers.append(server)
        return server, await server.start()

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def client():
    probe_client = HealthProbeClient()
    yield probe_client
    probe_client.close()


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_probes_reuse_one_kept_alive_connection(raw_server, client):
    server, url = await raw_server(lambda n: OK)
    for _ in range(5):
        answer = await client.probe(url, 2)
        assert answer.status == 200
    assert server.requests == 5 and server.connections == 1 and client.connections_opened == 1
    assert server.last_request.startswith(b"GET /health_generate HTTP/1.1\r\nHost: 127.0.0.1:")


async def test_a_url_prefix_is_kept_in_the_request_path(raw_server, client):
    server, url = await raw_server(lambda n: OK)
    await client.probe(url + "/e/7/", 2)
    assert server.last_request.startswith(b"GET /e/7/health_generate HTTP/1.1\r\n")


async def test_a_connection_the_server_closed_while_idle_is_reopened(raw_server, client):
    # The first answer asks to close; the next probe opens a fresh connection.
    server, url = await raw_server(lambda n: OK.replace(b"server", b"connection: close\r\nserver") if n == 1 else OK)
    await client.probe(url, 2)
    await asyncio.sleep(0.05)
    assert client.open_connections() == 0
    await client.probe(url, 2)
    assert server.connections == 2 and server.requests == 2


async def test_a_request_lost_to_a_closing_idle_connection_is_retried_once(raw_server, client):
    # Request 2 meets a connection the server closes without answering (its keep-alive ran out as
    # the request went out): the probe tries once more on a fresh connection and succeeds.
    server, url = await raw_server(lambda n: None if n == 2 else OK)
    await client.probe(url, 2)
    answer = await client.probe(url, 2)
    assert answer.status == 200 and server.requests == 3 and server.connections == 2


async def test_a_server_that_closes_without_answering_is_connection_closed(raw_server, client):
    server, url = await raw_server(lambda n: None)
    with pytest.raises(ConnectionClosed, match="without a response"):
        await client.probe(url, 2)
    assert server.requests == 1  # a fresh connection is not retried


async def test_nothing_listening_is_connection_refused(client):
    with pytest.raises(ConnectionRefused) as info:
        await client.probe(f"http://127.0.0.1:{unused_port()}", 2)
    assert info.value.engine_gone and info.value.url.endswith("/health_generate")


async def test_silence_is_a_bounded_timeout_and_the_connection_is_dropped(raw_server, client):
    server, url = await raw_server(lambda n: "hang" if n == 1 else OK)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(CallTimeout, match="within 0.3 s"):
        await client.probe(url, 0.3)
    assert 0.3 <= loop.time() - started < 1.0
    await asyncio.sleep(0.05)
    assert server.closed_by_client == 1  # dropped, so a late answer can never count for the next probe
    assert (await client.probe(url, 2)).status == 200 and server.connections == 2


async def test_a_cancelled_probe_drops_its_connection_and_the_next_one_works(raw_server, client):
    server, url = await raw_server(lambda n: "hang" if n == 1 else OK)
    task = asyncio.create_task(client.probe(url, 5))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await client.probe(url, 2)).status == 200 and server.connections == 2


async def test_one_probe_per_engine_at_a_time(raw_server, client):
    _, url = await raw_server(lambda n: "hang")
    first = asyncio.create_task(client.probe(url, 5))
    await asyncio.sleep(0.05)
    with pytest.raises(RuntimeError, match="already in flight"):
        await client.probe(url, 1)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first


@pytest.mark.parametrize("status,error", [(503, ServiceUnavailable), (404, ClientErrorStatus),
                                          (500, ServerErrorStatus)])
async def test_error_statuses_are_classified_and_keep_the_connection(raw_server, client, status, error):
    reply = f"HTTP/1.1 {status} X\r\ncontent-length: 4\r\n\r\nnope".encode()
    server, url = await raw_server(lambda n: reply)
    for _ in range(2):
        with pytest.raises(error) as info:
            await client.probe(url, 2)
        assert info.value.status == status and info.value.body == "nope"
    assert server.connections == 1


async def test_garbage_is_a_bad_response_and_drops_the_connection(raw_server, client):
    server, url = await raw_server(lambda n: b"hello, this is not HTTP\r\n\r\n" if n == 1 else OK)
    with pytest.raises(BadResponse, match="status line"):
        await client.probe(url, 2)
    assert (await client.probe(url, 2)).status == 200 and server.connections == 2


async def test_aiohttp_answers_chunked_and_plain(client):
    async def plain(request):
        return web.Response(status=200)

    async def chunked(request):
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"still ")
        await response.write(b"healthy")
        await response.write_eof()
        return response

    async with serving([web.get("/health_generate", plain), web.get("/c/health_generate", chunked)]) as url:
        for _ in range(3):
            assert (await client.probe(url, 2)).status == 200
            assert (await client.probe(url + "/c", 2)).body == b"still healthy"
        assert client.connections_opened == 2


async def test_forget_and_close_release_connections(raw_server, client):
    server, url = await raw_server(lambda n: OK)
    _, other = await raw_server(lambda n: OK)
    await client.probe(url, 2)
    await client.probe(other, 2)
    assert client.open_connections() == 2
    client.forget(url)
    assert client.open_connections() == 1 and len(client) == 1
    client.close()
    await asyncio.sleep(0.05)
    assert client.open_connections() == 0 and server.closed_by_client == 1


def test_bad_urls_and_timeouts_are_rejected():
    client = HealthProbeClient()
    with pytest.raises(ValueError, match="http://"):
        asyncio.run(client.probe("https://engine:443", 1))
    with pytest.raises(ValueError, match="positive"):
        asyncio.run(client.probe("http://127.0.0.1:1", 0))


# --- watching kept-alive connections between probes --------------------------------------------

class Refusals:
    def __init__(self):
        self.seen: list[tuple[float, str, Exception]] = []
        self.event = asyncio.Event()

    def __call__(self, url: str, error: Exception) -> None:
        self.seen.append((asyncio.get_running_loop().time(), url, error))
        self.event.set()


async def test_a_process_that_dies_between_probes_is_reported_at_once(raw_server):
    server, url = await raw_server(lambda n: OK)
    refusals = Refusals()
    client = HealthProbeClient(on_refused=refusals)
    try:
        await client.probe(url, 2)
        crashed_at = asyncio.get_running_loop().time()
        server.crash()
        await asyncio.wait_for(refusals.event.wait(), 5)
        (at, where, error), = refusals.seen
        assert where == url and isinstance(error, ConnectionRefused)
        assert at - crashed_at < 2  # at once, not at the next probe (none is made here)
    finally:
        client.close()


async def test_a_keep_alive_timeout_is_not_a_refusal_and_the_watch_connection_serves_the_next_probe(raw_server):
    server, url = await raw_server(lambda n: OK, idle_close_s=0.2)
    refusals = Refusals()
    client = HealthProbeClient(on_refused=refusals)
    try:
        await client.probe(url, 2)
        # The server closed the idle connection; the client reconnected.
        await until(lambda: client.connections_opened == 2 and client.open_connections() == 1)
        assert refusals.seen == []
        await client.probe(url, 2)
        assert client.connections_opened == 2 and server.requests == 2
        await until(lambda: client.connections_opened == 3)  # closed again after use: watched again
        # The unused watch connection was closed too: not replaced.
        await until(lambda: server.closed_idle == 3 and client.open_connections() == 0)
        await asyncio.sleep(0.3)
        assert client.connections_opened == 3 and client.open_connections() == 0
        assert server.closed_idle == 3 and refusals.seen == []
    finally:
        client.close()


async def test_without_a_watcher_idle_connections_are_not_reopened(raw_server, client):
    server, url = await raw_server(lambda n: OK, idle_close_s=0.1)
    await client.probe(url, 2)
    await until(lambda: server.closed_idle == 1 and client.open_connections() == 0)
    await asyncio.sleep(0.3)
    assert client.connections_opened == 1 and client.open_connections() == 0


async def test_the_monitor_marks_an_engine_dead_when_its_idle_connection_is_refused(raw_server):
    from rlfleet.crds.specs import HealthSpec
    from rlfleet.orchestrator.fleet.monitor import REFUSAL_GRACE_S, HealthMonitor, ProbeTarget

    server, url = await raw_server(lambda n: OK)
    held_server, other = await raw_server(lambda n: OK)
    deaths: list[tuple[float, int, str]] = []

    async def on_dead(target: ProbeTarget, reason: str) -> None:
        deaths.append((asyncio.get_running_loop().time(), target.slot, reason))

    # Probes every 30 s: only the connection watch can notice the crash within the test.
    spec = HealthSpec(interval_seconds=30, timeout_seconds=2, failure_threshold=3)
    monitor = HealthMonitor(spec, targets=lambda: [ProbeTarget(0, 1, url), ProbeTarget(1, 1, other)],
                            on_dead=on_dead, fleet="watch-test")
    await monitor.start()
    try:
        await asyncio.sleep(0.3)  # the first round answered
        monitor.hold(1, "heat guard")  # a held engine is left alone, whatever its port does
        crashed_at = asyncio.get_running_loop().time()
        server.crash()
        held_server.crash()
        await until(lambda: bool(deaths), timeout_s=REFUSAL_GRACE_S + 5)
        await asyncio.sleep(0.5)  # and no death of the held engine after it
    finally:
        await monitor.stop()
    (at, slot, reason), = deaths
    assert slot == 0 and REFUSAL_GRACE_S <= at - crashed_at < REFUSAL_GRACE_S + 5
    assert reason.startswith("connection refused, nothing listens on the engine's port")


async def test_a_death_the_backend_reports_first_is_not_reported_again(raw_server):
    from rlfleet.crds.specs import HealthSpec
    from rlfleet.orchestrator.fleet.monitor import REFUSAL_GRACE_S, HealthMonitor, ProbeTarget

    server, url = await raw_server(lambda n: OK)
    deaths: list[str] = []

    async def on_dead(target: ProbeTarget, reason: str) -> None:
        deaths.append(reason)

    spec = HealthSpec(interval_seconds=30, timeout_seconds=2, failure_threshold=3)
    monitor = HealthMonitor(spec, targets=lambda: [ProbeTarget(0, 1, url)], on_dead=on_dead, fleet="watch-test")
    await monitor.start()
    try:
        await asyncio.sleep(0.3)
        server.crash()
        await asyncio.sleep(0.05)
        monitor.forget(0, 1)  # the process watch saw the exit first, with its exit code and log
        await asyncio.sleep(REFUSAL_GRACE_S + 0.3)
    finally:
        await monitor.stop()
    assert deaths == []
