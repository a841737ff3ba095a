"""Pydantic models -> structural OpenAPI v3 schemas as the Kubernetes API server accepts them.

Structural means: every node has a type, no `$ref`, no `anyOf` with null (an optional field is just
not required; the API server prunes nulls), no `additionalProperties: false` (unknown fields are
rejected by strict field validation). On top of pydantic's schema this adds what it cannot say:
full defaults of nested objects and lists (so a minimal object read back has every default filled), and
each model's cross-field rules as `x-kubernetes-validations`.
"""
from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, TypeAdapter

from rlfleet.crds.rules import object_rules


class SchemaError(ValueError):
    """A model uses a construct that has no structural-schema equivalent."""


def reachable_models(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model class reachable from `root` through field annotations, by class name."""
    found: dict[str, type[BaseModel]] = {}

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            other = found.get(annotation.__name__)
            if other is annotation:
                return
            if other is not None:
                raise SchemaError(f"two models are named {annotation.__name__}: {other} and {annotation}")
            found[annotation.__name__] = annotation
            for info in annotation.model_fields.values():
                visit(info.annotation)
            return
        for arg in typing.get_args(annotation):
            visit(arg)

    visit(root)
    return found


def _wire_default(info: Any) -> tuple[bool, Any]:
    """(has a default worth emitting, its wire value).

    A nested object's default is written out in full: the API server checks defaults against the
    object's CEL rules without applying the inner defaults first.
    """
    if info.is_required():
        return False, None
    value = info.get_default(call_default_factory=True)
    if value is None:
        return False, None
    if isinstance(value, BaseModel):
        return True, value.model_dump(mode="json", by_alias=True, exclude_none=True)
    return True, TypeAdapter(type(value)).dump_python(value, mode="json")


class _Converter:
    def __init__(self, root: type[BaseModel]):
        self.classes = reachable_models(root)
        raw = root.model_json_schema(by_alias=True, mode="validation")
        self.defs: dict[str, Any] = raw.pop("$defs", {})
        self.defs.setdefault(root.__name__, raw)
        for name in self.defs:
            if name not in self.classes:
                raise SchemaError(f"schema definition {name} has no model class (duplicate class names?)")

    def model(self, name: str) -> dict[str, Any]:
        cls = self.classes[name]
        out = self.node(self.defs[name])
        if out.get("type") != "object":
            raise SchemaError(f"{name} is not an object")
        properties = out.get("properties", {})
        for field_name, info in cls.model_fields.items():
            key = info.alias or field_name
            has_default, value = _wire_default(info)
            if has_default:
                properties[key]["default"] = value
        validations = [rule.to_validation() for rule in object_rules(cls)]
        if validations:
            out["x-kubernetes-validations"] = validations
        return out

    def node(self, node: dict[str, Any]) -> dict[str, Any]:
        out = self._node(node)
        if "enum" in out and "type" not in out:
            out["type"] = _enum_type(out["enum"])
        if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            raise SchemaError(f"schema node without a type: {node}")
        return out

    def _node(self, node: dict[str, Any]) -> dict[str, Any]:
        node = dict(node)
        if "$ref" in node:
            name = node.pop("$ref").rsplit("/", 1)[-1]
            base = self.model(name)
            if "description" in node:
                base["description"] = node["description"]
            return base
        if "allOf" in node:
            (only,) = node.pop("allOf")
            return {**self.node(only), **self._plain(node)}
        if "anyOf" in node:
            options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
            if len(options) != 1:
                raise SchemaError(f"a union of several types has no structural schema: {options}")
            return {**self.node(options[0]), **self._plain(node)}
        return self._plain(node)

    def _plain(self, node: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("title", "default"):
                continue
            if key == "properties":
                out["properties"] = {k: self.node(v) for k, v in value.items()}
            elif key == "items":
                out["items"] = self.node(value)
            elif key == "additionalProperties":
                if value is False:
                    continue
                if value is True or value == {}:
                    out["x-kubernetes-preserve-unknown-fields"] = True
                else:
                    out["additionalProperties"] = self.node(value)
            elif key == "const":
                out["enum"] = [value]
            elif key == "exclusiveMinimum":
                out["minimum"], out["exclusiveMinimum"] = value, True
            elif key == "exclusiveMaximum":
                out["maximum"], out["exclusiveMaximum"] = value, True
            elif key in ("$defs", "anyOf", "oneOf", "not", "$ref"):
                raise SchemaError(f"unsupported schema keyword {key}")
            else:
                out[key] = value
        return out


def _enum_type(values: list[Any]) -> str:
    kinds = {type(v) for v in values}
    if kinds == {str}:
        return "string"
    if kinds <= {int}:
        return "integer"
    raise SchemaError(f"enum of mixed types: {values}")


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of `model` (an object) with defaults and cross-field rules."""
    return _Converter(model).model(model.__name__)


def walk(schema: dict[str, Any], path: str = "") -> typing.Iterator[tuple[str, dict[str, Any]]]:
    """(dotted path, node) for every node of a converted schema; list items are written `[]`."""
    yield path, schema
    for key, child in schema.get("properties", {}).items():
        yield from walk(child, f"{path}.{key}" if path else key)
    if "items" in schema:
        yield from walk(schema["items"], path + "[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], path + "{}")
