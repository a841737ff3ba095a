"""Classified failures of calls to engines and the router (one kind per way a call can fail).

Callers decide what a failure means from its kind (an engine that refuses connections is gone; a
503 is a busy or paused engine; a 400 is our bug or bad input), so every client raises a CallError
whose `kind` says which of these happened. The classification itself is pure.
"""
from __future__ import annotations

import asyncio
import errno
from enum import StrEnum

import aiohttp


class FailureKind(StrEnum):
    """What went wrong with one HTTP call. Values double as metric label values."""

    CONNECTION_REFUSED = "connection_refused"  # nothing listens: the process is gone
    TIMEOUT = "timeout"  # no complete answer within the call's bound: hung or overloaded
    CONNECTION_CLOSED = "connection_closed"  # accepted, then closed without a response: died mid-call
    UNAVAILABLE = "unavailable"  # HTTP 503
    CLIENT_ERROR = "client_error"  # other HTTP 4xx
    SERVER_ERROR = "server_error"  # other HTTP 5xx
    ABORTED = "aborted"  # HTTP 200 whose finish_reason.type is "abort"
    BAD_RESPONSE = "bad_response"  # a 2xx whose body is not what the API promises


# Kinds after which the engine process should be presumed gone (not merely slow).
ENGINE_GONE_KINDS = frozenset({FailureKind.CONNECTION_REFUSED, FailureKind.CONNECTION_CLOSED})


class CallError(Exception):
    """One failed HTTP call, classified. Subclasses exist per kind so callers may `except` by type."""

    kind: FailureKind = FailureKind.BAD_RESPONSE

    def __init__(self, message: str, *, method: str = "", url: str = "", status: int | None = None,
                 body: str = "", elapsed_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.method = method
        self.url = url
        self.status = status
        self.body = body
        self.elapsed_s = elapsed_s

    @property
    def engine_gone(self) -> bool:
        return self.kind in ENGINE_GONE_KINDS

    def __str__(self) -> str:
        where = f"{self.method} {self.url}".strip()
        status = f" HTTP {self.status}" if self.status is not None else ""
        took = f" after {self.elapsed_s:.2f} s" if self.elapsed_s is not None else ""
        return f"{where}:{status} {self.kind.value}{took}: {self.message}" if where else self.message


class ConnectionRefused(CallError):
    kind = FailureKind.CONNECTION_REFUSED


class CallTimeout(CallError):
    kind = FailureKind.TIMEOUT


class ConnectionClosed(CallError):
    kind = FailureKind.CONNECTION_CLOSED


class ServiceUnavailable(CallError):
    kind = FailureKind.UNAVAILABLE


class ClientErrorStatus(CallError):
    kind = FailureKind.CLIENT_ERROR


class ServerErrorStatus(CallError):
    kind = FailureKind.SERVER_ERROR


class RequestAborted(CallError):
    kind = FailureKind.ABORTED


class BadResponse(CallError):
    kind = FailureKind.BAD_RESPONSE


ERROR_CLASSES: dict[FailureKind, type[CallError]] = {
    cls.kind: cls
    for cls in (ConnectionRefused, CallTimeout, ConnectionClosed, ServiceUnavailable, ClientErrorStatus,
                ServerErrorStatus, RequestAborted, BadResponse)
}


def classify_status(status: int) -> FailureKind | None:
    """The failure kind of an HTTP status, or None for a success (2xx/3xx)."""
    if status == 503:
        return FailureKind.UNAVAILABLE
    if 400 <= status < 500:
        return FailureKind.CLIENT_ERROR
    if status >= 500:
        return FailureKind.SERVER_ERROR
    return None


def classify_exception(exc: BaseException) -> FailureKind | None:
    """The failure kind of a transport exception raised by aiohttp, or None if it is not one."""
    # Order matters: aiohttp's timeout errors subclass both ClientError and TimeoutError.
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return FailureKind.TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Could not open a connection at all (refused, unreachable, reset during connect).
        return FailureKind.CONNECTION_REFUSED
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return FailureKind.CONNECTION_CLOSED
    if isinstance(exc, aiohttp.ClientOSError):
        if exc.errno == errno.ECONNREFUSED:
            return FailureKind.CONNECTION_REFUSED
        return FailureKind.CONNECTION_CLOSED  # reset / broken pipe on an open connection
    if isinstance(exc, aiohttp.ClientResponseError):
        return classify_status(exc.status) or FailureKind.BAD_RESPONSE
    if isinstance(exc, aiohttp.ClientError):
        return FailureKind.CONNECTION_CLOSED
    return None


def error_for(kind: FailureKind, message: str, **context) -> CallError:
    """Build the CallError subclass for a kind."""
    return ERROR_CLASSES[kind](message, **context)
