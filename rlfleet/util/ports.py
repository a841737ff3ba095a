"""Free ports and per-engine loopback addresses (127.0.0.N), so engines never fight over a port."""
from __future__ import annotations

import itertools
import os
import socket
import threading

_lock = threading.Lock()
# Spread concurrent processes (several test sessions, dev clusters) over different addresses.
_next_host = itertools.count(2 + (os.getpid() * 7) % 200)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on host that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def next_loopback_host() -> str:
    """A fresh 127.0.0.N address (N in 2..254), cycling."""
    with _lock:
        n = next(_next_host)
    return f"127.0.0.{2 + (n - 2) % 253}"


def allocate_endpoint() -> tuple[str, int]:
    """A loopback address of its own and a free port on it."""
    host = next_loopback_host()
    return host, free_port(host)
