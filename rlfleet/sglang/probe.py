"""A lean client for health probes: GET /health_generate over one kept-alive connection per engine.

Why not aiohttp: a general client costs ~200-250 us of CPU per request (session, connector pool,
response object, header multidict); at 1,000 engines probed every second that alone is a quarter of a
core. A probe here is one write and one read on an open HTTP/1.1 connection, parsed just enough.

- One connection per engine URL, opened on first use and kept alive; reopened when the server closed it.
- A request that meets a closed reused connection before any byte of an answer (the server closed its
  idle connection as we sent; uvicorn does so after 5 s idle) is retried once on a fresh connection,
  which is allowed for an idempotent GET (RFC 9110 9.2.2).
- Every probe is bounded by its timeout: connect, send and the whole answer. A probe that times out or
  is cancelled closes its connection, so a late answer can never be read as the next probe's.
- A probe is a future resolved by the connection's callbacks, with one timer: no task per probe
  (a task only while a connection opens), since at 1,000 probes a second per-probe overhead is most
  of the prober's CPU.
- Between probes a kept-alive connection doubles as a wire to the engine: when it ends while idle,
  the client reconnects at once and reports a refusal (optional `on_refused`).
- Answers: status line, headers, body by Content-Length, chunked, or until close. A 2xx succeeds;
  anything else raises the CallError of its kind (errors.py): refused connections (nothing listens:
  the process is gone), timeouts, connections closed without an answer, 503, other 4xx/5xx, garbage.
"""
from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import urlsplit

from rlfleet.sglang.errors import (
    BadResponse,
    CallError,
    CallTimeout,
    ConnectionClosed,
    ConnectionRefused,
    classify_status,
    error_for,
)

HEALTH_PATH = "/health_generate"
MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
BODY_EXCERPT_CHARS = 300


class ProbeAnswer(NamedTuple):
    """A complete HTTP answer to a probe."""

    status: int
    body: bytes
    keep_alive: bool


class IncompleteAnswer(Exception):
    """The connection ended before the answer was complete."""


# --- the response parser (pure) -------------------------------------------------------------------

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class ResponseParser:
    """Incremental parser of one HTTP/1.x answer to a GET (RFC 9112, the parts a health answer uses).

    `feed(data)` returns the ProbeAnswer once complete, else None; `feed_eof()` ends a body that runs
    until close, or raises IncompleteAnswer. Malformed input raises BadResponse.
    """

    __slots__ = ("_buf", "_state", "_status", "_keep_alive", "_remaining", "_body", "received", "_max_body")

    def __init__(self, max_body: int = MAX_BODY_BYTES):
        self._buf = b""
        self._state = _HEAD
        self._status = 0
        self._keep_alive = True
        self._remaining = 0
        self._body = b""
        self.received = 0  # bytes seen so far (0: the peer never started an answer)
        self._max_body = max_body

    def feed(self, data: bytes) -> ProbeAnswer | None:
        self.received += len(data)
        buf = self._buf + data if self._buf else data
        self._buf = b""
        while True:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise BadResponse(f"response head longer than {MAX_HEAD_BYTES} bytes")
                    self._buf = buf
                    return None
                self._parse_head(buf[:end])
                buf = buf[end + 4:]
                if self._state == _DONE:
                    return self._answer(buf)
            elif state == _LENGTH:
                take = buf[:self._remaining]
                self._body += take
                self._remaining -= len(take)
                if self._remaining == 0:
                    return self._answer(buf[len(take):])
                return None
            elif state == _UNTIL_CLOSE:
                self._append(buf)
                return None
            elif state in (_CHUNK_SIZE, _TRAILER, _CHUNK_END):
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise BadResponse("chunk line too long")
                    self._buf = buf
                    return None
                line, buf = buf[:end], buf[end + 2:]
                if state == _CHUNK_END:
                    if line:
                        raise BadResponse("chunk data not followed by CRLF")
                    self._state = _CHUNK_SIZE
                elif state == _TRAILER:
                    if not line:  # the empty line that ends the trailer section
                        self._state = _DONE
                        return self._answer(buf)
                else:
                    size_text = line.split(b";", 1)[0].strip()
                    try:
                        size = int(size_text, 16)
                    except ValueError:
                        raise BadResponse(f"bad chunk size {size_text[:20]!r}") from None
                    if size < 0:
                        raise BadResponse("negative chunk size")
                    if size == 0:
                        self._state = _TRAILER
                    else:
                        if len(self._body) + size > self._max_body:
                            raise BadResponse(f"response body over {self._max_body} bytes")
                        self._remaining = size
                        self._state = _CHUNK_DATA
            elif state == _CHUNK_DATA:
                take = buf[:self._remaining]
                self._body += take
                self._remaining -= len(take)
                buf = buf[len(take):]
                if self._remaining:
                    return None
                self._state = _CHUNK_END
            else:  # _DONE: bytes after a complete answer
                raise BadResponse("data after a complete response")

    def feed_eof(self) -> ProbeAnswer:
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
            return ProbeAnswer(self._status, self._body, False)
        raise IncompleteAnswer("connection closed before the response was complete" if self.received
                               else "connection closed without a response")

    def _append(self, data: bytes) -> None:
        if len(self._body) + len(data) > self._max_body:
            raise BadResponse(f"response body over {self._max_body} bytes")
        self._body += data

    def _answer(self, rest: bytes) -> ProbeAnswer:
        if rest:
            raise BadResponse("data after a complete response")
        self._state = _DONE
        return ProbeAnswer(self._status, self._body, self._keep_alive)

    def _parse_head(self, head: bytes) -> None:
        eol = head.find(b"\r\n")
        status_line, fields = (head, b"") if eol < 0 else (head[:eol], head[eol:].lower())
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or not code.isdigit() or rest[3:4] not in (b"", b" "):
            raise BadResponse(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status = int(code)
        # Only the fields that frame the answer are read; the others do not matter to a probe.
        length: int | None = None
        value = _field(fields, b"\r\ncontent-length:")
        if value is not None:
            if not value.isdigit():
                raise BadResponse(f"bad Content-Length {value[:20]!r}")
            length = int(value)
        chunked = (_field(fields, b"\r\ntransfer-encoding:") or b"").endswith(b"chunked")
        connection = _field(fields, b"\r\nconnection:") or b""
        if 100 <= status < 200:
            # An interim answer (100 Continue) before the real one: a GET without Expect gets none.
            raise BadResponse(f"unexpected interim response {status}")
        self._status = status
        if version == b"HTTP/1.1":
            self._keep_alive = b"close" not in connection
        else:
            self._keep_alive = b"keep-alive" in connection
        if status == 204 or status == 304:
            self._state = _DONE
        elif chunked:
            self._state = _CHUNK_SIZE
        elif length is not None:
            if length > self._max_body:
                raise BadResponse(f"response body of {length} bytes is over {self._max_body}")
            self._remaining = length
            self._state = _DONE if length == 0 else _LENGTH
        else:
            self._state = _UNTIL_CLOSE  # no length: the body ends when the server closes
            self._keep_alive = False


def _field(fields: bytes, marker: bytes) -> bytes | None:
    """The value of the header field that `marker` (CRLF + lower-case name + colon) starts, if any.

    A field sent twice must carry the same value (RFC 9110 8.6 for Content-Length).
    """
    start = fields.find(marker)
    if start < 0:
        return None
    start += len(marker)
    end = fields.find(b"\r\n", start)
    value = fields[start:end if end >= 0 else None].strip()
    if end >= 0 and fields.find(marker, end) >= 0 and _field(fields[end:], marker) != value:
        raise BadResponse(f"conflicting {marker[2:-1].decode()} fields")
    return value


# --- one connection -------------------------------------------------------------------------------

class _ProbeConnection(asyncio.Protocol):
    """One HTTP/1.1 connection of an endpoint, with at most one request in flight.

    It reports answers and early ends to its owner, and an idle connection's end too (the server
    closed it, or its process died). A connection closed on purpose has no owner and reports nothing.
    """

    __slots__ = ("transport", "open", "owner", "busy", "used", "_parser")

    def __init__(self, owner: _Endpoint) -> None:
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.owner: _Endpoint | None = owner
        self.busy = False  # a request is in flight
        self.used = False  # carried at least one request
        self._parser: ResponseParser | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport), "a TCP connection has a stream transport"
        self.transport = transport
        self.open = True

    def request(self, data: bytes) -> None:
        self._parser = ResponseParser()
        self.busy = self.used = True
        assert self.transport is not None, "requests go out on open connections only"
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        owner = self.owner
        if owner is None or not self.busy:
            self.abort()  # bytes nobody asked for: this stream can no longer be trusted
            return
        assert self._parser is not None, "a busy connection has its request's parser"
        try:
            reply = self._parser.feed(data)
        except BadResponse as exc:
            self.abort()
            owner.failed(exc)
            return
        if reply is not None:
            self.busy = False
            if not reply.keep_alive:
                self.close()
            owner.answered(reply)

    def eof_received(self) -> bool:
        self._ended(None)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)

    def _ended(self, exc: Exception | None) -> None:
        self.open = False
        owner, self.owner = self.owner, None
        if owner is None:
            return
        if not self.busy:
            owner.idle_closed(self)
            return
        self.busy = False
        parser = self._parser
        assert parser is not None, "a busy connection has its request's parser"
        try:
            reply = parser.feed_eof()
        except IncompleteAnswer as incomplete:
            detail = f"{incomplete}" + (f" ({exc})" if exc else "")
            owner.closed_early(detail, got_bytes=parser.received > 0)
        else:
            owner.answered(reply)

    def close(self) -> None:
        """Close after what was written; nothing more is reported (the server asked to close)."""
        self.open = False
        self.owner = None
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close at once and never report again (the owner has moved on)."""
        self.open = False
        self.owner = None
        if self.transport is not None:
            self.transport.abort()


# --- one engine -----------------------------------------------------------------------------------

class _Endpoint:
    """One engine URL: its address, request bytes, connection, and the probe in flight (at most one).

    A probe is a future resolved from the connection's callbacks and one timer; a task exists only
    while a connection is being opened.
    """

    __slots__ = ("client", "url", "where", "host", "port", "request", "connection", "result", "timer", "started",
                 "timeout_s", "reused", "opening", "watching", "exchange", "loop")

    def __init__(self, client: HealthProbeClient, url: str, path: str):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"health probes need an http://host[:port][/prefix] URL, got {url!r}")
        self.client = client
        self.url = url
        self.where = url.rstrip("/") + path
        self.host = parts.hostname
        self.port = parts.port or 80
        target = parts.path.rstrip("/") + path
        host_header = parts.netloc.rpartition("@")[2]
        self.request = (f"GET {target} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: rlfleet-probe\r\n"
                        f"Accept: */*\r\n\r\n").encode("latin-1")
        self.connection: _ProbeConnection | None = None
        self.result: asyncio.Future | None = None  # the probe in flight
        self.timer: asyncio.TimerHandle | None = None
        self.opening: asyncio.Task | None = None
        self.watching: asyncio.Task | None = None  # reconnecting after an idle connection ended
        self.started = 0.0
        self.timeout_s = 0.0
        self.reused = False
        self.exchange = 0  # counts probes, so late callbacks of an earlier one are recognised
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def busy(self) -> bool:
        return self.result is not None and not self.result.done()

    def start(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> asyncio.Future:
        if self.result is not None:
            # An earlier probe was cancelled before it settled: its connection may still carry its
            # answer, so it cannot be trusted.
            self.abandon()
        self._stop_watching()
        self.exchange += 1
        self.loop = loop
        self.result = result = loop.create_future()
        self.started = started = loop.time()
        self.timeout_s = timeout_s
        self.timer = loop.call_at(started + timeout_s, self._expire, self.exchange)
        connection = self.connection
        if connection is not None and connection.open:
            self.reused = True
            connection.request(self.request)
        else:
            self.reused = False
            self._open(loop)
        return result

    # --- connection callbacks

    def answered(self, reply: ProbeAnswer) -> None:
        result = self._settle()
        if result is None or result.done():
            return  # cancelled meanwhile; the connection finished its exchange and stays usable
        status = reply.status
        if 200 <= status < 300:
            result.set_result(reply)
            return
        kind = classify_status(status)
        text = reply.body[:BODY_EXCERPT_CHARS].decode("utf-8", "replace")
        assert self.loop is not None, "start() set the loop"
        elapsed = self.loop.time() - self.started
        if kind is None:
            error: CallError = BadResponse(f"unexpected status {status}", method="GET", url=self.where, status=status)
        else:
            error = error_for(kind, text or "(empty body)", method="GET", url=self.where, status=status,
                              body=text, elapsed_s=elapsed)
        result.set_exception(error)

    def closed_early(self, detail: str, got_bytes: bool) -> None:
        if self.reused and not got_bytes and self.result is not None and not self.result.done():
            # The server closed the idle connection as the request went out (e.g. uvicorn's 5 s
            # keep-alive): a GET may be sent again, once, on a fresh connection.
            self.reused = False
            self.connection = None
            assert self.loop is not None, "start() set the loop"
            self._open(self.loop)
            return
        self.failed(ConnectionClosed(detail, method="GET", url=self.where))

    def idle_closed(self, connection: _ProbeConnection) -> None:
        """An idle connection ended: the server closed it (keep-alive timeout, shutdown) or the
        engine's process died. With a watcher, reconnect at once: a refusal tells the engine is gone
        without waiting for the next probe. A watch connection that ends unused is not replaced."""
        if connection is not self.connection:
            return
        self.connection = None
        if self.client.on_refused is None or not connection.used or self.result is not None or self.loop is None:
            return
        self.watching = self.loop.create_task(self._watch(self.loop))

    def failed(self, error: CallError) -> None:
        if not error.url:
            error.method, error.url = "GET", self.where
        result = self._settle()
        self.drop()
        if result is not None and not result.done():
            result.set_exception(error)

    # --- internals

    def _expire(self, exchange: int) -> None:
        if exchange != self.exchange or self.result is None:
            return
        self.timer = None
        assert self.loop is not None, "start() set the loop"
        self.failed(CallTimeout(f"no complete answer within {self.timeout_s:g} s", method="GET", url=self.where,
                                elapsed_s=self.loop.time() - self.started))

    def _settle(self) -> asyncio.Future | None:
        """End the probe in flight (timer, opening task); returns its future."""
        result, self.result = self.result, None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        opening, self.opening = self.opening, None
        if opening is not None and opening is not asyncio.current_task():
            opening.cancel()
        return result

    def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.drop()
        self.opening = loop.create_task(self._connect(loop, self.exchange))

    async def _new_connection(self, loop: asyncio.AbstractEventLoop) -> _ProbeConnection | CallError:
        """A new connection, or the classified reason there is none."""
        try:
            _, connection = await loop.create_connection(lambda: _ProbeConnection(self), self.host, self.port)
        except OSError as exc:
            if isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED:
                return ConnectionRefused(f"connection refused ({exc.strerror or exc})", method="GET", url=self.where)
            # Unreachable, reset while connecting, no local ports or descriptors: not proof the
            # engine is gone, so not a refusal.
            return ConnectionClosed(f"cannot connect: {exc}", method="GET", url=self.where)
        self.client.connections_opened += 1
        return connection

    async def _connect(self, loop: asyncio.AbstractEventLoop, exchange: int) -> None:
        connection = await self._new_connection(loop)
        if isinstance(connection, CallError):
            if exchange == self.exchange:
                self.failed(connection)
            return
        if exchange != self.exchange or self.result is None or self.result.done():
            connection.abort()  # the probe ended (cancelled, timed out) while connecting
            return
        self.opening = None
        self.connection = connection
        connection.request(self.request)

    async def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        connection = await self._new_connection(loop)
        self.watching = None
        if isinstance(connection, CallError):
            if isinstance(connection, ConnectionRefused) and self.result is None and self.client.on_refused:
                self.client.on_refused(self.url, connection)
            return
        if self.connection is None and self.result is None:
            self.connection = connection  # kept for the next probe (and watched in turn)
        else:
            connection.abort()

    def _stop_watching(self) -> None:
        watching, self.watching = self.watching, None
        if watching is not None and watching is not asyncio.current_task():
            watching.cancel()

    def drop(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.abort()

    def abandon(self) -> None:
        """Forget the probe in flight, if any, and its connection."""
        result = self._settle()
        self._stop_watching()
        self.drop()
        if result is not None and not result.done():
            result.cancel()


# --- the client -----------------------------------------------------------------------------------

class HealthProbeClient:
    """Probes engines' /health_generate over persistent connections (one per engine URL).

    `submit(url, timeout_s)` starts a probe and returns its future: the ProbeAnswer of a 2xx, or the
    classified CallError. `await probe(url, timeout_s)` is the same as a coroutine. One probe per URL
    at a time; cancelling the future abandons the probe (and its connection). `forget(url)` closes
    an engine's connection when it leaves the fleet; `close()` closes them all.

    `on_refused(url, error)`, if given, watches the kept-alive connections between probes: when one
    ends while idle, the client reconnects at once, and a refusal is reported (the engine's process
    is gone). A process that dies is then known in milliseconds, not at the next probe.
    """

    def __init__(self, path: str = HEALTH_PATH, *, on_refused: Callable[[str, CallError], None] | None = None):
        if not path.startswith("/"):
            raise ValueError(f"probe path must start with '/', got {path!r}")
        self.path = path
        self.on_refused = on_refused
        self._endpoints: dict[str, _Endpoint] = {}
        self.connections_opened = 0  # over the client's life: a steady fleet opens one per engine

    def __len__(self) -> int:
        return len(self._endpoints)

    def open_connections(self) -> int:
        return sum(1 for e in self._endpoints.values() if e.connection is not None and e.connection.open)

    def submit(self, url: str, timeout_s: float) -> asyncio.Future:
        """Start one probe of `url`, bounded by `timeout_s` (connect, send, whole answer)."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        endpoint = self._endpoints.get(url)
        if endpoint is None:
            endpoint = self._endpoints[url] = _Endpoint(self, url, self.path)
        elif endpoint.busy:
            raise RuntimeError(f"a probe of {url} is already in flight")
        return endpoint.start(asyncio.get_running_loop(), timeout_s)

    async def probe(self, url: str, timeout_s: float) -> ProbeAnswer:
        return await self.submit(url, timeout_s)

    def forget(self, url: str) -> None:
        endpoint = self._endpoints.pop(url, None)
        if endpoint is not None:
            endpoint.abandon()

    def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.abandon()
        self._endpoints.clear()
