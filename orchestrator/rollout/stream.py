"""One streamed POST /generate (`stream: true`): every chunk handed over as it arrives, failures classified
like every other call (rlfleet.sglang.errors).

SGLang streams server-sent events, `data: <json>\\n\\n`, the last one with a non-null `finish_reason`,
then `data: [DONE]`; each chunk carries all tokens so far, or only its new ones when the engine runs
with `--incremental-streaming-output` as rlfleet starts it (rlfleet.orchestrator.rollout.continuation
joins both). A mid-stream error is a chunk `{"error": {...}}`. A stream that ends (or whose connection
breaks) before the final chunk failed as a closed connection; an abort (`finish_reason.type` "abort", e.g.
a weight update that aborts in-flight requests) raises RequestAborted after its chunk, with its partial
output, was handed over.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from rlfleet.sglang.engine import finish_reason_type
from rlfleet.sglang.errors import (
    BadResponse,
    CallError,
    ConnectionClosed,
    FailureKind,
    RequestAborted,
    classify_status,
    error_for,
)
from rlfleet.sglang.http import BODY_EXCERPT_CHARS, transport_error

ChunkSink = Callable[[dict[str, Any]], object]
EVENT_END = b"\n\n"
DONE = "[DONE]"


def parse_event(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one server-sent event; None for `[DONE]` or an event without data."""
    data = b"\n".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")).decode(
        "utf-8", errors="replace").strip()
    if not data or data == DONE:
        return None
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise BadResponse(f"stream chunk is not JSON: {data[:BODY_EXCERPT_CHARS]!r}") from exc
    if not isinstance(chunk, dict):
        raise BadResponse(f"stream chunk is not a JSON object: {data[:BODY_EXCERPT_CHARS]!r}")
    return chunk


def error_of_chunk(chunk: Mapping[str, Any], **context: Any) -> CallError | None:
    """The classified error a mid-stream `{"error": ...}` chunk stands for (its code, else a 5xx)."""
    error = chunk.get("error")
    if error is None:
        return None
    detail = error if isinstance(error, dict) else {"message": str(error)}
    code = detail.get("code")
    status = code if isinstance(code, int) else None
    kind = (classify_status(status) if status is not None else None) or FailureKind.SERVER_ERROR
    message = str(detail.get("message") or error)[:BODY_EXCERPT_CHARS]
    return error_for(kind, f"stream error: {message}", status=status, body=json.dumps(chunk), **context)


async def stream_generate(session: aiohttp.ClientSession, url: str, payload: Mapping[str, Any], timeout_s: float,
                          on_chunk: ChunkSink, *, connect_timeout_s: float) -> dict[str, Any]:
    """POST the request with `stream: true`; `on_chunk(chunk)` for every chunk; returns the final chunk.

    Bounded by `timeout_s` (connect, headers and the whole stream) and `connect_timeout_s` for the
    connection alone. Raises the classified CallError; an abort raises RequestAborted.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    started = time.monotonic()
    context: dict[str, Any] = {"method": "POST", "url": url}
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(connect_timeout_s, timeout_s))
        async with session.post(url, json={**payload, "stream": True}, timeout=timeout) as response:
            if response.status != 200:
                text = await response.text(errors="replace")
                status_kind = classify_status(response.status) or FailureKind.BAD_RESPONSE
                raise error_for(status_kind, text[:BODY_EXCERPT_CHARS] or "(empty body)", status=response.status,
                                body=text, elapsed_s=time.monotonic() - started, **context)
            buffer = bytearray()
            async for data in response.content.iter_any():
                buffer += data
                while (end := buffer.find(EVENT_END)) >= 0:
                    event = bytes(buffer[:end])
                    del buffer[:end + len(EVENT_END)]
                    chunk = parse_event(event)
                    if chunk is None:
                        continue
                    failed = error_of_chunk(chunk, elapsed_s=time.monotonic() - started, **context)
                    if failed is not None:
                        raise failed
                    on_chunk(chunk)
                    reason = finish_reason_type(chunk)
                    if reason == "abort":
                        message = (chunk.get("meta_info") or {}).get("finish_reason", {}).get("message") or "aborted"
                        raise RequestAborted(message, status=response.status, body=json.dumps(chunk)[:4000],
                                             elapsed_s=time.monotonic() - started, **context)
                    if reason is not None:
                        return chunk
    except CallError:
        raise
    except Exception as exc:
        if (error := transport_error(exc, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                     elapsed_s=time.monotonic() - started, **context)) is None:
            raise
        raise error from exc
    raise ConnectionClosed("stream ended before the generation finished", elapsed_s=time.monotonic() - started,
                           **context)
