"""Kubernetes-style conditions: set one while keeping its transition time, and make reasons valid.

Pure helpers shared by the fleet and TrainingRun status aggregation.
"""
from __future__ import annotations

import datetime as dt
import re

from rlfleet.util.redact import redact

MESSAGE_MAX = 32768


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def reason_word(text: str, default: str = "Unknown") -> str:
    """A CamelCase condition/event reason from free text: `probe_failed`, `probe failed` -> `ProbeFailed`."""
    words = re.findall(r"[A-Za-z0-9]+", text or "")
    word = "".join(w[:1].upper() + w[1:] for w in words)
    word = word.lstrip("0123456789")
    word = word[:1].upper() + word[1:]
    return word[:128] if word else default


def clip(message: str, limit: int = MESSAGE_MAX) -> str:
    """Keep the end of a long message (where an engine's last log lines are)."""
    return message if len(message) <= limit else "..." + message[-(limit - 3):]


def condition(kind: str, ok: bool, reason: str, message: str, *, now: float, previous: list[dict] | None,
              generation: int | None = None) -> dict:
    status = "True" if ok else "False"
    old = next((c for c in previous or [] if c.get("type") == kind), None)
    since = (old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime")
             else iso(now))
    cond = {"type": kind, "status": status, "reason": reason_word(reason), "message": clip(redact(message)),
            "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def find(conditions: list[dict] | None, kind: str) -> dict | None:
    return next((c for c in conditions or [] if c.get("type") == kind), None)


def is_true(conditions: list[dict] | None, kind: str) -> bool:
    c = find(conditions, kind)
    return bool(c and c.get("status") == "True")
