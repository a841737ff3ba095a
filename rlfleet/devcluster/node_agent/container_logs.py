"""Pure rules of the node agent's container-log endpoint (the kubelet's `/containerLogs`), without I/O.

kube-apiserver serves `kubectl logs` (`GET /api/v1/namespaces/NS/pods/NAME/log`) by proxying to the
kubelet of the pod's node: HTTPS to the Node's preferred address on
`status.daemonEndpoints.kubeletEndpoint.Port`, path `/containerLogs/NS/NAME/CONTAINER`, with the query
parameters below. The node agent answers it from `<data-dir>/logs/<namespace>_<pod>_<uid>/<container>.log`.

Supported: `tailLines` (the last N lines), `limitBytes` (stop after N bytes), `follow` (stream new output
until the container's process ends). Not supported, answered 400 with the reason: `previous` (a restarted
container appends to the same file: the log holds every run), `timestamps`, `sinceSeconds`, `sinceTime`
(the file records no times), and `stream` other than `All` (stdout and stderr share one file).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

READ_BLOCK = 64 * 1024  # bytes read at a time, scanning back for the tail and streaming forward

# Go's strconv.ParseBool, which the kubelet uses for its boolean query parameters.
_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}


class LogRequestError(ValueError):
    """A log request that cannot be answered; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class LogRequest:
    namespace: str
    pod: str
    container: str
    tail_lines: int | None = None  # None: the whole log
    follow: bool = False
    limit_bytes: int | None = None


def _bool(query: Mapping[str, str], name: str) -> bool:
    value = query.get(name)
    if value is None or value == "":
        return False
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise LogRequestError(400, f"{name}={value!r} is not a boolean")


def _non_negative_int(query: Mapping[str, str], name: str) -> int | None:
    value = query.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise LogRequestError(400, f"{name}={value!r} is not an integer") from None
    if number < 0:
        raise LogRequestError(400, f"{name} must be 0 or more, got {number}")
    return number


def parse_log_request(namespace: str, pod: str, container: str, query: Mapping[str, str]) -> LogRequest:
    """The request for /containerLogs/{namespace}/{pod}/{container}?query; LogRequestError(400) if unsupported."""
    for name, value in (("namespace", namespace), ("pod", pod), ("container", container)):
        if not value or "/" in value or value in (".", ".."):
            raise LogRequestError(400, f"invalid {name} {value!r} in the log path")
    if _bool(query, "previous"):
        raise LogRequestError(400, "previous=true is not supported by the rlfleet node agent: a restarted "
                                   "container appends to the same log, which holds every run")
    if _bool(query, "timestamps"):
        raise LogRequestError(400, "timestamps=true is not supported by the rlfleet node agent: its logs "
                                   "record no times")
    for name in ("sinceSeconds", "sinceTime"):
        if query.get(name):
            raise LogRequestError(400, f"{name} is not supported by the rlfleet node agent: its logs record no times")
    stream = query.get("stream")
    if stream not in (None, "", "All"):
        raise LogRequestError(400, f"stream={stream!r} is not supported by the rlfleet node agent: stdout and "
                                   "stderr share one log")
    limit = _non_negative_int(query, "limitBytes")
    if limit == 0:
        raise LogRequestError(400, "limitBytes must be 1 or more")
    return LogRequest(namespace, pod, container, tail_lines=_non_negative_int(query, "tailLines"),
                      follow=_bool(query, "follow"), limit_bytes=limit)


def log_dir_name(namespace: str, pod: str, uid: str) -> str:
    """The directory under `<data-dir>/logs` that holds a pod's container logs."""
    return f"{namespace}_{pod}_{uid}"


def tail_start(size: int, read_at: Callable[[int, int], bytes], lines: int, block: int = READ_BLOCK) -> int:
    """The offset where the last `lines` lines of a file of `size` bytes begin.

    read_at(offset, length) returns bytes of the file. The file is scanned backwards one block at a time,
    so memory stays bounded whatever its size. A last line without its newline (still being written)
    counts as a line; the newline that ends the file does not start one.
    """
    if lines <= 0 or size <= 0:
        return size
    end = size
    if read_at(size - 1, 1) == b"\n":
        end -= 1  # the final newline ends the last line
    found = 0
    while end > 0:
        start = max(0, end - block)
        chunk = read_at(start, end - start)
        index = len(chunk)
        while True:
            index = chunk.rfind(b"\n", 0, index)
            if index < 0:
                break
            found += 1
            if found == lines:
                return start + index + 1
        end = start
    return 0


def clip_to_limit(chunk: bytes, sent: int, limit: int | None) -> bytes:
    """The part of chunk that still fits under limitBytes once `sent` bytes went out."""
    if limit is None:
        return chunk
    return chunk[:max(0, limit - sent)]


class FollowStep(Enum):
    SEND = "send"  # new bytes: send them and read again at once
    WAIT = "wait"  # nothing new yet and the container runs: poll again shortly
    END = "end"    # nothing new and the container had ended before the read: the stream is complete


def follow_step(new_bytes: int, running_before_read: bool) -> FollowStep:
    """What a follower does after one read. Whether the container runs must be checked BEFORE the read:
    everything it wrote before it ended is then in the file, so an empty read after it ended is the end."""
    if new_bytes:
        return FollowStep.SEND
    return FollowStep.WAIT if running_before_read else FollowStep.END

