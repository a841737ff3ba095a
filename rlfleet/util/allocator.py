"""The malloc a CPU engine runs with: jemalloc when this machine has it.

A broadcast weight sync has SGLang receive each bucket into a freshly allocated tensor. glibc serves an
allocation that large with a fresh mmap and unmaps it when freed, so every sync faults every page of
every bucket in again: receiving 1 GiB took 1.40 s of the trainer's broadcast instead of 0.30 s for the
same bytes into a buffer already touched (measured with a real CPU engine, benchmarks/bench_weight_sync.py).
jemalloc, told never to purge (`rlfleet.sglang.launch.JEMALLOC_CONF`), keeps the freed pages and hands
them to the next bucket: 0.39 s.
"""
from __future__ import annotations

from pathlib import Path

# Debian/Ubuntu (x86_64, arm64), then RPM-style and plain library directories.
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


def find_jemalloc(candidates: tuple[str, ...] = JEMALLOC_PATHS) -> str | None:
    """The first jemalloc shared library that exists here, or None."""
    return next((path for path in candidates if Path(path).is_file()), None)
