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
- Answers: status line, headers, body by Content-Length, chunked, or until close. A 2xx succeeds;
  anything else raises the CallError of its kind (errors.py): refused connections (nothing listens:
  the process is gone), timeouts, connections closed without an answer, 503, other 4xx/5xx, garbage.
"""
from __future__ import annotations

import asyncio
import errno
from typing import NamedTuple
from urllib.parse import urlsplit

from rlfleet.orchestrator.errors import (
    BadResponse,
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
            elif state == _CHUNK_SIZE or state == _TRAILER or state == _CHUNK_END:
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
        status_line, fields = (head, b"") if eol < 0 else (head[:eol], head[eol + 2:].lower())
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or not code.isdigit() or rest[3:4] not in (b"", b" "):
            raise BadResponse(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status = int(code)
        length: int | None = None
        chunked = False
        connection = b""
        if fields:
            for line in fields.split(b"\r\n"):
                name, colon, value = line.partition(b":")
                if name == b"content-length":
                    value = value.strip()
                    if not value.isdigit() or (length is not None and int(value) != length):
                        raise BadResponse(f"bad Content-Length {value[:20]!r}")
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = value.strip().endswith(b"chunked")
                elif name == b"connection":
                    connection = value.strip()
                elif not colon or not name or name[-1] in (32, 9):  # no name, or whitespace before ':'
                    raise BadResponse(f"malformed header line {line[:80]!r}")
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


# --- one connection -------------------------------------------------------------------------------

class _Closed(Exception):
    """The connection ended before the answer was complete; `got_bytes` says whether any arrived."""

    def __init__(self, message: str, got_bytes: bool):
        super().__init__(message)
        self.got_bytes = got_bytes


class _ProbeConnection(asyncio.Protocol):
    """One HTTP/1.1 connection: at most one request in flight; answers are handed over in a future."""

    __slots__ = ("transport", "open", "_parser", "_answer")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.open = False
        self._parser: ResponseParser | None = None
        self._answer: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    def request(self, data: bytes, answer: asyncio.Future) -> None:
        self._parser = ResponseParser()
        self._answer = answer
        self.transport.write(data)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None or answer.done():
            self.abort()  # bytes nobody asked for: this stream can no longer be trusted
            return
        try:
            reply = self._parser.feed(data)  # type: ignore[union-attr]
        except BadResponse as exc:
            self._answer = None
            self.abort()
            answer.set_exception(exc)
            return
        if reply is not None:
            self._answer = None
            if not reply.keep_alive:
                self.close()
            answer.set_result(reply)

    def eof_received(self) -> bool:
        self._ended(None)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)

    def _ended(self, exc: Exception | None) -> None:
        self.open = False
        answer, self._answer = self._answer, None
        if answer is None or answer.done():
            return
        parser = self._parser
        try:
            answer.set_result(parser.feed_eof())  # type: ignore[union-attr]
        except IncompleteAnswer as incomplete:
            detail = f"{incomplete}" + (f" ({exc})" if exc else "")
            answer.set_exception(_Closed(detail, got_bytes=parser.received > 0))  # type: ignore[union-attr]

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.abort()


def _expire(answer: asyncio.Future) -> None:
    if not answer.done():
        answer.set_exception(TimeoutError())


# --- the client -----------------------------------------------------------------------------------

class _Endpoint:
    """What one engine URL needs: address, the request bytes, its connection."""

    __slots__ = ("url", "host", "port", "request", "connection", "busy")

    def __init__(self, url: str, path: str):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"health probes need an http://host[:port][/prefix] URL, got {url!r}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        target = parts.path.rstrip("/") + path
        host_header = parts.netloc.rpartition("@")[2]
        self.request = (f"GET {target} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: rlfleet-probe\r\n"
                        f"Accept: */*\r\n\r\n").encode("latin-1")
        self.connection: _ProbeConnection | None = None
        self.busy = False

    def drop(self) -> None:
        if self.connection is not None:
            self.connection.abort()
            self.connection = None


class HealthProbeClient:
    """Probes engines' /health_generate over persistent connections (one per engine URL).

    `await probe(url, timeout_s)` returns the ProbeAnswer of a 2xx and raises the classified CallError
    otherwise. One probe per URL at a time. `forget(url)` closes an engine's connection when it leaves
    the fleet; `close()` closes them all.
    """

    def __init__(self, path: str = HEALTH_PATH):
        if not path.startswith("/"):
            raise ValueError(f"probe path must start with '/', got {path!r}")
        self.path = path
        self._endpoints: dict[str, _Endpoint] = {}

    def __len__(self) -> int:
        return len(self._endpoints)

    def open_connections(self) -> int:
        return sum(1 for e in self._endpoints.values() if e.connection is not None and e.connection.open)

    async def probe(self, url: str, timeout_s: float) -> ProbeAnswer:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        endpoint = self._endpoints.get(url)
        if endpoint is None:
            endpoint = self._endpoints[url] = _Endpoint(url, self.path)
        if endpoint.busy:
            raise RuntimeError(f"a probe of {url} is already in flight")
        endpoint.busy = True
        loop = asyncio.get_running_loop()
        started = loop.time()
        ok = False
        try:
            answer = await self._exchange(endpoint, loop, started + timeout_s)
            ok = True
        except TimeoutError:
            raise CallTimeout(f"no complete answer within {timeout_s:g} s", method="GET",
                              url=url + self.path, elapsed_s=loop.time() - started) from None
        finally:
            endpoint.busy = False
            if not ok:
                endpoint.drop()  # a late answer must never be taken for the next probe's
        status = answer.status
        if 200 <= status < 300:
            return answer
        kind = classify_status(status)
        text = answer.body[:BODY_EXCERPT_CHARS].decode("utf-8", "replace")
        if kind is None:
            raise BadResponse(f"unexpected status {status}", method="GET", url=url + self.path, status=status)
        raise error_for(kind, text or "(empty body)", method="GET", url=url + self.path, status=status,
                        body=text, elapsed_s=loop.time() - started)

    async def _exchange(self, endpoint: _Endpoint, loop: asyncio.AbstractEventLoop,
                        deadline: float) -> ProbeAnswer:
        connection = endpoint.connection
        reused = connection is not None and connection.open
        if not reused:
            connection = await self._connect(endpoint, loop, deadline)
        try:
            return await self._send(endpoint, connection, loop, deadline)
        except _Closed as closed:
            if reused and not closed.got_bytes:
                # The server closed the idle connection as the request went out: once more, afresh.
                connection = await self._connect(endpoint, loop, deadline)
                try:
                    return await self._send(endpoint, connection, loop, deadline)
                except _Closed as again:
                    closed = again
            raise ConnectionClosed(str(closed), method="GET", url=endpoint.url + self.path) from None

    async def _send(self, endpoint: _Endpoint, connection: _ProbeConnection, loop: asyncio.AbstractEventLoop,
                    deadline: float) -> ProbeAnswer:
        answer = loop.create_future()
        # One timer handle per probe (cheaper than asyncio.timeout, which matters at 1,000 probes/s).
        timer = loop.call_at(deadline, _expire, answer)
        connection.request(endpoint.request, answer)
        try:
            return await answer
        except BadResponse as exc:
            exc.method, exc.url = "GET", endpoint.url + self.path
            raise
        finally:
            timer.cancel()

    async def _connect(self, endpoint: _Endpoint, loop: asyncio.AbstractEventLoop,
                       deadline: float) -> _ProbeConnection:
        endpoint.drop()
        where = endpoint.url + self.path
        try:
            async with asyncio.timeout_at(deadline):
                _, connection = await loop.create_connection(_ProbeConnection, endpoint.host, endpoint.port)
        except ConnectionRefusedError as exc:
            raise ConnectionRefused(f"connection refused ({exc.strerror or exc})", method="GET", url=where) from None
        except OSError as exc:
            # Unreachable, reset during connect, no local ports or descriptors: not proof the engine is gone.
            if exc.errno == errno.ECONNREFUSED:
                raise ConnectionRefused(f"connection refused ({exc})", method="GET", url=where) from None
            raise ConnectionClosed(f"cannot connect: {exc}", method="GET", url=where) from None
        endpoint.connection = connection
        return connection

    def forget(self, url: str) -> None:
        endpoint = self._endpoints.pop(url, None)
        if endpoint is not None:
            endpoint.drop()

    def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.drop()
        self._endpoints.clear()

