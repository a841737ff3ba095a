"""Kubernetes value syntaxes the API server checks in the objects the operator builds.

A value of a spec that ends up in a child object (a pod's image, a label, a resource quantity, a
claim name, a mount path) is checked up front with the same syntax, both in the CRD schema (patterns,
CEL) and in the loader, so a manifest the API server accepts never yields a child it refuses.
Patterns are RE2-compatible (CEL `matches`) and mean the same in Python's `re`.
"""
from __future__ import annotations

import re
from decimal import Decimal

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$"
# Service names (`<fleet>-router`) are DNS-1035 labels: a letter first.
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY = rf"^({_DNS_LABEL}(\.{_DNS_LABEL})*/)?{_LABEL_NAME}$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
# Standard container resources, or a domain-qualified extended resource (example.com/foo).
RESOURCE_NAME = (rf"^(cpu|memory|ephemeral-storage|hugepages-[0-9A-Za-z]+|{_DNS_LABEL}(\.{_DNS_LABEL})+/"
                 rf"{_LABEL_NAME})$")
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
# registry[:port]/path[:tag][@digest], lower-case path components (what the container runtime accepts).
IMAGE = (r"^([A-Za-z0-9.-]+(:[0-9]+)?/)?[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*"
         r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")
# An absolute path without `..` or `:` elements, not the root itself.
MOUNT_PATH = r"^(/[^/:]+)+/?$"
HTTP_URL = r"^https?://[^\s/]+(/\S*)?$"
# The GPU resource the gpus / gpusPerEngine fields set; resources may not name it too.
GPU_RESOURCE = "nvidia.com/gpu"

_SUFFIX = {
    "": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}


def quantity(text: str) -> Decimal | None:
    """The value of a Kubernetes quantity in QUANTITY form (None when it is not one)."""
    m = re.match(r"^([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)$", text)
    if not m or not re.match(QUANTITY, text):
        return None
    return Decimal(m.group(1)) * _SUFFIX[m.group(2)]


def path_has_dot_dot(path: str) -> bool:
    return ".." in path.split("/")


def matches(pattern: str, value: str) -> bool:
    return re.match(pattern, value) is not None


def cel_re(pattern: str) -> str:
    """A pattern as a CEL raw string literal (backslashes kept as written)."""
    assert "'" not in pattern, "patterns are quoted with '"
    return f"r'{pattern}'"
