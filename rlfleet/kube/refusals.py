"""What a refused write of a child object means: the API server's answer sorted by what to do. Pure.

- PERMANENT: the object as built will never be admitted (422 Invalid, 400, 403 from an admission rule:
  Pod Security, a LimitRange's bounds, a quota that requires limits). The owner shows a condition with
  reason ChildRejected and the server's message, and stops trying until its spec changes.
- WAIT: refused for a reason that someone else's action clears (quota exceeded, the ServiceAccount not
  created yet, the operator's own RBAC, a namespace being deleted, a name taken by a foreign object):
  shown as ChildRejected too, and retried with backoff.
- RETRY: not a refusal (no answer, 429, 5xx, 401...): retried with backoff, no condition.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    PERMANENT = "permanent"
    WAIT = "wait"
    RETRY = "retry"


# Substrings of 403 messages whose cause lies outside the object and clears without changing it.
_CLEARS_BY_ITSELF = (
    "exceeded quota",  # other pods finish, or the quota is raised
    "error looking up service account",  # ServiceAccount admission: the account is created later
    "is being terminated",  # the namespace is going away
    "cannot create resource",  # RBAC of the operator itself
    "cannot patch resource",
    "cannot update resource",
)


def classify(status: int, message: str) -> Verdict:
    """What to do about an API server answer `status` with `message` to a create or patch."""
    if status in (400, 422):
        return Verdict.PERMANENT
    if status == 403:
        text = message.lower()
        return Verdict.WAIT if any(s in text for s in _CLEARS_BY_ITSELF) else Verdict.PERMANENT
    return Verdict.RETRY


@dataclass(frozen=True)
class Rejection:
    """A child the API server refused: which one, the server's words, and whether it is final."""

    kind: str
    name: str
    message: str
    permanent: bool
    status: int = 0

    def text(self) -> str:
        return f"the API server refused {self.kind} {self.name}: {self.message}"


def rejection(kind: str, name: str, status: int, message: str) -> Rejection | None:
    """A Rejection for a refusal (PERMANENT or WAIT), None for an answer to retry quietly."""
    verdict = classify(status, message)
    if verdict is Verdict.RETRY:
        return None
    return Rejection(kind, name, message or f"HTTP {status}", verdict is Verdict.PERMANENT, status)
