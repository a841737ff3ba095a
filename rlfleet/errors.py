"""The base of every error that ends a run: it carries the reason the run's Failed condition gives.

`reason` is one CamelCase word, as Kubernetes condition reasons are (`EngineCrashLoop`,
`SnapshotInvalid`, ...): each subclass names its own, and an instance may give a more precise one.
The run loop turns any RunError into the run's failure with that reason and the error's message.
"""
from __future__ import annotations


class RunError(Exception):
    """An error that ends a run; `reason` is its condition reason (CamelCase)."""

    reason: str = "RunFailed"

    def __init__(self, *args: object, reason: str | None = None):
        super().__init__(*args)
        if reason is not None:
            self.reason = reason
