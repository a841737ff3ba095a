"""The API reference page, rendered from the same schemas the CRDs carry."""
from __future__ import annotations

import json
from typing import Any

from rlfleet.crds import API_VERSION
from rlfleet.crds.crd import openapi_schema
from rlfleet.crds.miles_flags import MILES_FLAGS, NO_DEFAULT
from rlfleet.crds.models import KINDS, Kind
from rlfleet.crds.schema import walk


def _type(node: dict[str, Any]) -> str:
    kind = node.get("type", "any")
    if "enum" in node:
        return "one of " + ", ".join(f"`{v}`" for v in node["enum"])
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type(node['additionalProperties'])}"
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return "free-form object"
    if node.get("format"):
        return f"{kind} ({node['format']})"
    return kind


def _bounds(node: dict[str, Any]) -> str:
    parts = []
    if "minimum" in node:
        parts.append(f"{'>' if node.get('exclusiveMinimum') else '≥'} {node['minimum']}")
    if "maximum" in node:
        parts.append(f"{'<' if node.get('exclusiveMaximum') else '≤'} {node['maximum']}")
    if "minLength" in node and node["minLength"] > 0:
        parts.append(f"length ≥ {node['minLength']}")
    if "maxLength" in node:
        parts.append(f"length ≤ {node['maxLength']}")
    if "maxItems" in node:
        parts.append(f"≤ {node['maxItems']} items")
    if "maxProperties" in node:
        parts.append(f"≤ {node['maxProperties']} entries")
    if "pattern" in node:
        parts.append(f"pattern `{node['pattern']}`")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    return f"`{json.dumps(node['default'])}`"


def field_rows(schema: dict[str, Any], prefix: str) -> list[tuple[str, dict[str, Any], bool]]:
    """(path, node, required) for every field under `schema`, depth first."""
    rows = []
    required_at: dict[str, set[str]] = {}
    for path, node in walk(schema, prefix):
        required_at[path] = set(node.get("required", []))
        if path == prefix or path.endswith(("[]", "{}")):
            continue  # the list or map row describes its items
        parent, _, name = path.rpartition(".")
        rows.append((path, node, name in required_at.get(parent, set())))
    return rows


def _rules(schema: dict[str, Any], prefix: str) -> list[str]:
    lines = []
    for path, node in walk(schema, prefix):
        for rule in node.get("x-kubernetes-validations", []):
            where = path + rule.get("fieldPath", "")
            when = " (on update)" if "oldSelf" in rule["rule"] else ""
            lines.append(f"| `{where}` | {_cell(rule['message'])}{when} | `{_cell(rule['rule'])}` |")
    return lines


def _kind_section(kind: Kind) -> list[str]:
    schema = openapi_schema(kind)
    out = [
        f"## {kind.kind}",
        "",
        schema["description"],
        "",
        f"`apiVersion: {API_VERSION}`, `kind: {kind.kind}`; plural `{kind.plural}`, short name "
        + ", ".join(f"`{s}`" for s in kind.short_names)
        + ", category `rlfleet`. Subresources: status"
        + (f", scale ({kind.scale.describe()})" if kind.scale is not None else "") + ".",
        "",
        "`kubectl get` columns: " + ", ".join(c.name for c in kind.columns if not c.priority)
        + (" (wide: " + ", ".join(c.name for c in kind.columns if c.priority) + ")"
           if any(c.priority for c in kind.columns) else "")
        + ".",
        "",
    ]
    for part in ("spec", "status"):
        sub = schema["properties"][part]
        out += [f"### {kind.kind} {part}", "", "| Field | Type | Default | Bounds | Description |",
                "|---|---|---|---|---|"]
        for path, node, required in field_rows(sub, part):
            description = node.get("description", "")
            if required:
                description = "**Required.** " + description
            out.append(
                f"| `{path}` | {_cell(_type(node))} | {_cell(_default(node))} | {_cell(_bounds(node))} "
                f"| {_cell(description)} |"
            )
        rules = _rules(sub, part)
        if rules:
            out += ["", f"Rules checked on {kind.kind} {part} (by the API server and by `rlfleet validate`):", "",
                    "| Field | Rule | CEL |", "|---|---|---|", *rules]
        out.append("")
    return out


def _miles_section() -> list[str]:
    out = [
        "## Miles settings and their TrainingRun fields",
        "",
        "| Miles | Miles default | TrainingRun field | Default here | Note |",
        "|---|---|---|---|---|",
    ]
    for m in MILES_FLAGS:
        default = "" if m.default is NO_DEFAULT else f"`{json.dumps(m.default)}`"
        field = f"`{m.field}`" if m.field else "-"
        out.append(f"| `{_cell(m.flag)}` | {_cell(m.miles_default)} | {field} | {default} | {_cell(m.note)} |")
    return out + [""]


def render() -> str:
    lines = [
        "# rlfleet API reference",
        "",
        "<!-- Generated from the models in rlfleet.crds by `make crds`; do not edit. -->",
        "",
        f"Group `{API_VERSION}`. The same models generate the CRDs (`crds/*.yaml`) and validate manifests in "
        "local runs (`rlfleet run`, `rlfleet validate`), so both reject the same input with the same message. "
        "Defaults are applied by the API server and by the local loader alike. Paths use `[]` for list items and "
        "`{}` for map values.",
        "",
        "A field either takes effect where the run runs or is refused there, naming it. `rlfleet run FILE` refuses "
        "the fields that shape pods when they differ from their defaults (images, ports, resources, node "
        "selectors and tolerations of the trainer, engines and routers; `spec.weightSync.mountPath`; the "
        "snapshot claim's `claimName`, `size`, `storageClassName`), and the Kubernetes-only ones (`valueFrom`, "
        "`spec.trainer.maxRestarts`, `spec.trainer.nodes` above 1, `spec.tracking.wandb.apiKey`). On "
        "Kubernetes the operator fails a run that sets `spec.weightSync.snapshotVolume.localPath` (reason "
        "InvalidSpec).",
        "",
    ]
    for kind in KINDS:
        lines += _kind_section(kind)
    lines += _miles_section()
    return "\n".join(lines).rstrip() + "\n"
