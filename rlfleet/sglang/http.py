"""One bounded HTTP call with classified failures: the single place where aiohttp errors are mapped.

Every call has a deadline that covers connect, send and the whole body. Transport failures and
non-accepted statuses raise the CallError subclass for their kind (rlfleet.sglang.errors).

`client_session(api_key)` is the one place the sessions towards engines and routers are opened: with
a key, every request on it carries `Authorization: Bearer <key>` (engines started with `--api-key`,
routers with `--api-key` and `--control-plane-api-keys`, answer 401 without it).
"""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import aiohttp

from rlfleet.sglang.errors import BadResponse, CallError, FailureKind, classify_exception, classify_status, error_for

BODY_EXCERPT_CHARS = 500


def new_api_key() -> str:
    """A fresh random key for one fleet (or one local run): 256 bits, hex (no `:`, which sglang-router's
    `id:name:role:key` format would split on)."""
    return secrets.token_hex(32)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# SGLang's HTTP server (uvicorn) closes a keep-alive connection after 5 s idle; aiohttp keeps one 15 s
# by default and may send the next request on it just as the server closes it: "Connection reset by
# peer" (seen once on /pause_generation, which marked a healthy engine dead). Clients drop idle
# connections first.
KEEPALIVE_S = 3.0


def fleet_connector() -> aiohttp.TCPConnector:
    """The connector of the orchestrator's sessions towards engines and routers: no connection cap (a
    thousand engines are probed in the same round, a rollout holds one per request), idle connections
    closed before the servers close them."""
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)


def client_session(api_key: str | None = None, **kwargs: Any) -> aiohttp.ClientSession:
    """A session whose every request sends the fleet's key (none: no Authorization header)."""
    headers = {**auth_headers(api_key), **(kwargs.pop("headers", None) or {})}
    return aiohttp.ClientSession(headers=headers or None, **kwargs)


@dataclass(frozen=True)
class Reply:
    """A completed HTTP exchange."""

    status: int
    text: str
    elapsed_s: float
    headers: dict[str, str]
    method: str = ""
    url: str = ""

    def json(self) -> Any:
        try:
            return json.loads(self.text) if self.text else None
        except ValueError as exc:
            raise BadResponse(f"body is not JSON: {self.text[:BODY_EXCERPT_CHARS]!r}", method=self.method,
                              url=self.url, status=self.status, body=self.text) from exc


def transport_error(exc: BaseException, *, timeout_s: float, connect_timeout_s: float | None, elapsed_s: float,
                    **context: Any) -> CallError | None:
    """The classified CallError for an exception of the transport (refused, reset, timed out), or None
    for one that is not (a bug, a cancellation: the caller re-raises it)."""
    kind = classify_exception(exc)
    if kind is None:
        return None
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        detail = f"no connection within {connect_timeout_s:g} s"
    elif kind is FailureKind.TIMEOUT:
        detail = f"no complete answer within {timeout_s:g} s"
    return error_for(kind, detail, elapsed_s=elapsed_s, **context)


async def call(session: aiohttp.ClientSession, method: str, url: str, *, timeout_s: float,
               json_body: Any = None, params: dict[str, str] | None = None,
               accept: Collection[int] = (), connect_timeout_s: float | None = None) -> Reply:
    """Send one request bounded by timeout_s and return the Reply.

    A 2xx is returned; so is any status listed in `accept` (for APIs whose 400 carries a result the
    caller must read). Anything else raises the classified CallError. `connect_timeout_s` bounds the
    connection alone (a peer that is gone without refusing: a blackholed address, a stopped process).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    started = time.monotonic()
    context = {"method": method, "url": url}
    try:
        kwargs: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s),
                                  "params": params}
        if json_body is not None:
            kwargs["json"] = json_body
        async with session.request(method, url, **kwargs) as response:
            text = await response.text(errors="replace")
            reply = Reply(status=response.status, text=text, elapsed_s=time.monotonic() - started,
                          headers=dict(response.headers), method=method, url=url)
    except Exception as exc:
        if (error := transport_error(exc, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                     elapsed_s=time.monotonic() - started, **context)) is None:
            raise
        raise error from exc
    failure = classify_status(reply.status)
    if failure is not None and reply.status not in accept:
        raise error_for(failure, reply.text[:BODY_EXCERPT_CHARS] or "(empty body)", status=reply.status,
                        body=reply.text, elapsed_s=reply.elapsed_s, **context)
    return reply


def is_connect_timeout(error: BaseException) -> bool:
    """Did this call time out before a connection was made (see `connect_timeout_s`)?"""
    return isinstance(error.__cause__, aiohttp.ConnectionTimeoutError)


def expect_dict(reply: Reply, what: str) -> dict[str, Any]:
    """The reply's JSON body, which must be an object."""
    body = reply.json()
    if not isinstance(body, dict):
        raise BadResponse(f"{what}: expected a JSON object, got {reply.text[:BODY_EXCERPT_CHARS]!r}",
                          method=reply.method, url=reply.url, status=reply.status, body=reply.text)
    return body
