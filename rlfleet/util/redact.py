"""Redaction of keys and tokens from text copied out of a process's log (status, Events, errors, summaries).

SGLang logs its whole server_args at start (`api_key='...'`), command lines carry `--api-key X`, and
environment dumps carry `HF_TOKEN=...`. Every copy of an engine's or router's log tail goes through
`redact`, so no such value leaves the log file it was written to. Pure.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"

# A name that looks like it holds a secret: ends in key, token, secret, password, ... (any case,
# any separator), e.g. api_key, admin-api-key, control-plane-api-keys, HF_TOKEN, clientSecret.
# `max_total_tokens` does not (the name must end there).
_SECRET_NAME = r"[A-Za-z0-9_.-]*(?:keys?|token|secrets?|password|passwd|pwd|credentials?|auth)"

_PATTERNS = (
    # --api-key VALUE, --api-key=VALUE, --hf-token VALUE
    re.compile(rf"(?i)(--{_SECRET_NAME})(=|\s+)(?!--)(\S+)"),
    # Authorization: Bearer VALUE / Basic VALUE (headers, curl lines)
    re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?(?:bearer|basic|token)?\s*)([^\s'\",]+)"),
    re.compile(r"(?i)(\bbearer\s+)([A-Za-z0-9._~+/=-]+)"),
    # api_key='VALUE', "api_key": "VALUE", HF_TOKEN=VALUE, token: VALUE
    re.compile(rf"(?i)(\b{_SECRET_NAME}['\"]?\s*[=:]\s*)('[^']*'|\"[^\"]*\"|[^\s,;)}}\]]+)"),
)

_KEEP = {"None", "null", "''", '""', MASK, f"'{MASK}'", f'"{MASK}"'}


def _mask(value: str) -> str:
    if value in _KEEP:
        return value
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[0] + MASK + value[0]
    return MASK


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with the values of secret-looking options, headers and variables (and every string
    of `secrets`, e.g. known key values) replaced by ***."""
    if not text:
        return text
    for value in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(value, MASK)
    flag, header, bearer, assignment = _PATTERNS
    text = flag.sub(lambda m: m.group(1) + m.group(2) + _mask(m.group(3)), text)
    text = header.sub(lambda m: m.group(1) + _mask(m.group(2)), text)
    text = bearer.sub(lambda m: m.group(1) + _mask(m.group(2)), text)
    return assignment.sub(lambda m: m.group(1) + _mask(m.group(2)), text)


def redact_lines(lines: Iterable[str], secrets: Iterable[str] = ()) -> list[str]:
    keep = tuple(secrets)
    return [redact(line, keep) for line in lines]
