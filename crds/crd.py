"""CustomResourceDefinition documents (apiextensions.k8s.io/v1) built from the models."""
from __future__ import annotations

import copy
import functools
import json
from typing import Any

from pydantic import BaseModel

from rlfleet.crds import GROUP, VERSION
from rlfleet.crds.models import CATEGORY, KINDS, NAME_PATTERN, Kind
from rlfleet.crds.schema import structural_schema, walk

HEADER = "# Generated from the models in rlfleet.crds by `make crds`; do not edit.\n"


def _metadata_schema(kind: Kind) -> dict[str, Any]:
    # CRD schemas may only restrict metadata.name and metadata.generateName.
    meta_model = kind.model.model_fields["metadata"].annotation
    assert isinstance(meta_model, type) and issubclass(meta_model, BaseModel), "metadata is a model"
    name_info = meta_model.model_fields["name"]
    limits = {type(m).__name__: m for m in name_info.metadata}
    schema: dict[str, Any] = {"type": "object"}
    max_len = getattr(limits.get("MaxLen"), "max_length", None)
    pattern = next((getattr(m, "pattern", None) for m in name_info.metadata if getattr(m, "pattern", None)), None)
    name: dict[str, Any] = {"type": "string"}
    if max_len is not None and max_len < 253:
        name["maxLength"] = max_len
    if pattern is not None and pattern != NAME_PATTERN:  # the API server checks DNS-1123 names itself
        name["pattern"] = pattern
    if len(name) > 1:
        schema["properties"] = {"name": name}
    return schema


def _with_defaults_in_descriptions(schema: dict[str, Any]) -> dict[str, Any]:
    """`kubectl explain` shows descriptions but not defaults: state scalar defaults in the text."""
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        default = node.get("default")
        if "default" in node and not isinstance(default, (dict, list)):
            text = node.get("description", "").rstrip()
            node["description"] = (text + " " if text else "") + f"Default: {json.dumps(default)}."
    return schema


def openapi_schema(kind: Kind) -> dict[str, Any]:
    """The whole object's schema: apiVersion, kind, metadata, spec and status (a fresh copy)."""
    return copy.deepcopy(_openapi_schema(kind))


@functools.cache
def _openapi_schema(kind: Kind) -> dict[str, Any]:
    return {
        "type": "object",
        "description": (kind.model.__doc__ or "").strip(),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "rlfleet.io/v1alpha1"},
            "kind": {"type": "string", "description": kind.kind},
            "metadata": _metadata_schema(kind),
            "spec": structural_schema(kind.spec_model),
            "status": structural_schema(kind.status_model),
        },
    }


def crd(kind: Kind) -> dict[str, Any]:
    subresources: dict[str, Any] = {"status": {}}
    if kind.scale is not None:
        subresources["scale"] = {
            "specReplicasPath": kind.scale.spec,
            "statusReplicasPath": kind.scale.status,
            "labelSelectorPath": kind.scale.selector,
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": kind.crd_name, "labels": {"app.kubernetes.io/part-of": "rlfleet"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.kind,
                "listKind": kind.kind + "List",
                "plural": kind.plural,
                "singular": kind.kind.lower(),
                "shortNames": list(kind.short_names),
                "categories": [CATEGORY],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": _with_defaults_in_descriptions(openapi_schema(kind))},
                    "subresources": subresources,
                    "additionalPrinterColumns": [c.to_crd() for c in kind.columns],
                }
            ],
        },
    }


def all_crds() -> list[tuple[Kind, dict[str, Any]]]:
    return [(kind, crd(kind)) for kind in KINDS]
