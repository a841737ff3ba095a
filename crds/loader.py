"""Read rlfleet manifests (YAML, several documents a file) through the typed models.

The local runner and `rlfleet validate` use this; it rejects what the API server rejects: the same
types (strict, no string-to-number coercion), bounds, enums, unknown fields and cross-field rules,
each error located by its field path (`spec.heatGuard.resumeAtC`) with the rule that failed.
Defaults are filled in exactly as the API server fills them. As on the API server, `status` in a
manifest is ignored (only the operator writes it).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from rlfleet.crds import API_VERSION
from rlfleet.crds.derive import eval_engine
from rlfleet.crds.models import KINDS_BY_NAME, TrainingRun, TrainingRunSpec
from rlfleet.crds.rules import RULE_ERROR_TYPE, check_transition
from rlfleet.crds.specs import EngineSpec, EnvVarSpec


@dataclass(frozen=True)
class FieldError:
    """One problem with a manifest: where (field path), what, and which rule or check."""

    path: str
    message: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path or '<document>'}: {self.message}"


@dataclass
class Document:
    """One YAML document of a file, validated."""

    index: int
    data: Any
    obj: BaseModel | None = None
    errors: list[FieldError] = field(default_factory=list)

    @property
    def kind(self) -> str | None:
        return self.data.get("kind") if isinstance(self.data, dict) else None

    @property
    def name(self) -> str | None:
        meta = self.data.get("metadata") if isinstance(self.data, dict) else None
        return meta.get("name") if isinstance(meta, dict) else None

    @property
    def label(self) -> str:
        return f"{self.kind or 'document'}/{self.name or f'#{self.index + 1}'}"


class ManifestError(ValueError):
    """A manifest that does not validate; `errors` lists every problem."""

    def __init__(self, source: str, errors: list[FieldError]):
        self.source = source
        self.errors = errors
        super().__init__(f"{source}: " + "; ".join(str(e) for e in errors))


# --- YAML as the API server reads it -------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """YAML with 1.2 numbers (1e-6 is a float), dates kept as strings, duplicate keys rejected."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping repeats a key: the API server would keep one of the two values silently."""

    def __init__(self, path: str, key: Any, line: int):
        self.path, self.key, self.line = path, key, line
        super().__init__(f"{path}: duplicate key {key!r} (line {line})")


def _duplicate_keys(node: yaml.Node, loc: tuple[str | int, ...]) -> None:
    """Raise DuplicateKeyError for the first repeated key under `node`, located by its field path."""
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            if key in seen:
                raise DuplicateKeyError(format_path(loc + (key,)), key, key_node.start_mark.line + 1)
            seen.add(key)
            _duplicate_keys(value_node, loc + (key,))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _duplicate_keys(item, loc + (i,))


def parse_yaml(text: str) -> list[Any]:
    """Every non-empty document of a YAML stream (a repeated key raises DuplicateKeyError)."""
    for node in yaml.compose_all(text, Loader=_Loader):
        if node is not None:
            _duplicate_keys(node, ())
    return [doc for doc in yaml.load_all(text, Loader=_Loader) if doc is not None]


# --- validation -----------------------------------------------------------------------------------

def format_path(loc: Iterable[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


_JSON_TYPES = {
    "int_type": "integer", "int_from_float": "integer", "int_parsing": "integer",
    "float_type": "number", "float_parsing": "number",
    "bool_type": "boolean", "bool_parsing": "boolean",
    "string_type": "string", "list_type": "array", "dict_type": "object",
    "model_type": "object", "model_attributes_type": "object",
}


def _message(error: ErrorDetails, path: str) -> str:
    """Pydantic's message, worded like the API server's where the two differ most."""
    kind = error["type"]
    if kind == "missing":
        return "Required value"
    if kind == "extra_forbidden":
        return f'unknown field "{path}"'
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        supported = ", ".join(part.strip().replace("'", '"') for part in re.split(r",| or ", expected) if part.strip())
        return f"Unsupported value: {json.dumps(error.get('input'))}: supported values: {supported}"
    if kind in _JSON_TYPES:
        return f"Invalid value: {json.dumps(error.get('input'), default=str)}: must be of type {_JSON_TYPES[kind]}"
    # "Input should be less than 1" -> "should be less than 1", as the API server says it.
    return re.sub(r"^(Input|String|List|Dictionary|Value) should", "should", error["msg"])


def errors_of(exc: ValidationError, prefix: tuple[str | int, ...] = ()) -> list[FieldError]:
    """A pydantic ValidationError as field errors; rule violations are split one per rule."""
    out = []
    for error in exc.errors(include_url=False):
        loc = prefix + tuple(error["loc"])
        if error["type"] == RULE_ERROR_TYPE:
            for violation in error["ctx"]["violations"]:
                sub = tuple(violation.field.split(".")) if violation.field else ()
                out.append(FieldError(format_path(loc + sub), violation.message, violation.rule))
        else:
            path = format_path(loc)
            out.append(FieldError(path, _message(error, path), error["type"]))
    return out


def validate_object(data: Any) -> tuple[BaseModel | None, list[FieldError]]:
    """Validate one manifest object; returns the model (defaults filled) or the errors."""
    if not isinstance(data, dict):
        return None, [FieldError("", "a manifest must be a mapping", "type")]
    errors = []
    if data.get("apiVersion") != API_VERSION:
        errors.append(FieldError("apiVersion", f"must be {API_VERSION}, got {data.get('apiVersion')!r}", "apiVersion"))
    kind_name = data.get("kind")
    kind = KINDS_BY_NAME.get(kind_name) if isinstance(kind_name, str) else None
    if kind is None:
        errors.append(FieldError(
            "kind", f"unknown kind {data.get('kind')!r}: expected one of {', '.join(KINDS_BY_NAME)}", "kind"
        ))
    if errors or kind is None:
        return None, errors
    body = {k: v for k, v in data.items() if k != "status"}
    try:
        return kind.model.model_validate(body), []
    except ValidationError as exc:
        return None, errors_of(exc)


def validate_update(old: Any, new: Any) -> list[FieldError]:
    """Errors of `new` as an update of the stored `old`: its own, then the transition rules."""
    new_obj, errors = validate_object(new)
    if errors:
        return errors
    old_obj, old_errors = validate_object(old)
    if old_errors or old_obj is None or new_obj is None or type(old_obj) is not type(new_obj):
        return [FieldError("", "the previous object is not a valid object of the same kind", "transition")]
    return [
        FieldError(format_path(path + (tuple(v.field.split(".")) if v.field else ())), v.message, v.rule)
        for path, v in check_transition(new_obj, old_obj)
    ]


def load_text(text: str) -> list[Document]:
    """Every document of a YAML stream, validated. A YAML syntax error raises ManifestError."""
    try:
        raw = parse_yaml(text)
    except DuplicateKeyError as exc:
        raise ManifestError("<yaml>", [FieldError(exc.path, f"duplicate key {exc.key!r} (line {exc.line})",
                                                  "yaml")]) from exc
    except yaml.YAMLError as exc:
        raise ManifestError("<yaml>", [FieldError("", f"not valid YAML: {exc}", "yaml")]) from exc
    documents = []
    for index, data in enumerate(raw):
        obj, errors = validate_object(data)
        documents.append(Document(index=index, data=data, obj=obj, errors=errors))
    return documents


def load_file(path: str | Path) -> list[Document]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(str(path), [FieldError("", f"cannot read: {exc.strerror}", "file")]) from exc
    try:
        return load_text(text)
    except ManifestError as exc:
        raise ManifestError(str(path), exc.errors) from None


def load_training_run(path: str | Path) -> TrainingRun:
    """The single TrainingRun of a manifest file, validated with defaults filled; else ManifestError."""
    documents = load_file(path)
    runs = [d for d in documents if d.kind == "TrainingRun"]
    errors = [e for d in runs for e in d.errors]
    if errors:
        raise ManifestError(str(path), errors)
    if len(runs) != 1:
        others = sorted({str(d.kind) for d in documents if d.kind != "TrainingRun"})
        found = f"found {len(runs)}" + (f" (and {', '.join(others)}: apply those to a cluster with the rlfleet "
                                         "operator)" if others else "")
        raise ManifestError(str(path), [FieldError("", f"expected one TrainingRun, {found}", "kind")])
    run = runs[0].obj
    assert isinstance(run, TrainingRun), "a TrainingRun document without errors validates as a TrainingRun"
    if derived := derivation_errors(run.spec):
        raise ManifestError(str(path), derived)
    return run


def derivation_errors(spec: TrainingRunSpec) -> list[FieldError]:
    """What a valid spec implies that cannot run, named by the field a user sets: the eval engine, the rollout
    engine with the eval fleet's overrides, must itself be a valid engine (on cuda, enough GPUs for its
    layout). The API server cannot compute the inheritance, so the operator fails such a run with these."""
    try:
        eval_engine(spec)
    except ValidationError as exc:
        return errors_of(exc, ("spec", "eval", "fleet", "engine"))
    return []


# --- local runs -----------------------------------------------------------------------------------

LOCAL_VALUE_FROM_MESSAGE = (
    "valueFrom (secretKeyRef, configMapKeyRef) needs the Kubernetes API server, which a local run "
    "(rlfleet run FILE) does not have: set value instead, or run the TrainingRun on Kubernetes"
)


def _models_with_paths(obj: Any, loc: tuple[str | int, ...]) -> Iterable[tuple[tuple[str | int, ...], BaseModel]]:
    if isinstance(obj, BaseModel):
        yield loc, obj
        for name, info in type(obj).model_fields.items():
            yield from _models_with_paths(getattr(obj, name), loc + (info.alias or name,))
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from _models_with_paths(item, loc + (i,))


LOCAL_MAX_RESTARTS_MESSAGE = ("recreates a trainer pod on Kubernetes; a local run has none (its trainer is this "
                              "process): set 0 or leave it out, and resume a stopped local run with "
                              "`rlfleet run FILE --resume`")


LOCAL_WANDB_API_KEY_MESSAGE = ("a Secret needs the Kubernetes API server, which a local run (rlfleet run FILE) "
                               "does not have: leave it out, and the W&B client uses this machine's own login "
                               "(`wandb login`, or WANDB_API_KEY in the environment)")


# What a local run uses instead of each field that shapes a pod (a local run has none: its engines, router
# and ranks are processes on this machine). Set to other than its default, such a field could not take
# effect, so the run refuses it rather than ignore it.
_LOCAL_INSTEAD = {
    "image": "the SGLang, sglang-router and rlfleet installed here",
    "port": "free ports it picks",
    "resources": "this machine's CPUs, memory and GPUs",
    "nodeSelector": "this machine",
    "tolerations": "this machine",
    "mountPath": "the snapshot directory (spec.weightSync.snapshotVolume.localPath)",
    "claimName": "a directory (spec.weightSync.snapshotVolume.localPath)",
    "size": "a directory (spec.weightSync.snapshotVolume.localPath)",
    "storageClassName": "a directory (spec.weightSync.snapshotVolume.localPath)",
}


def _pod_only_errors(path: str, model: BaseModel | None, names: tuple[str, ...],
                     defaults: type[BaseModel] | None = None) -> list[FieldError]:
    """The pod-shaping fields among `names` set on `model` to other than their defaults (`defaults`' when
    given: an override left unset is None, one set to the overridden model's default changes nothing)."""
    if model is None:
        return []
    errors = []
    for name in names:
        info = type(model).model_fields[name]
        default = (defaults or type(model)).model_fields[name].get_default(call_default_factory=True)
        value = getattr(model, name)
        if name in model.model_fields_set and value is not None and value != default:
            alias = info.alias or name
            errors.append(FieldError(f"{path}.{alias}", f"shapes a pod on Kubernetes; a local run has none and uses "
                                     f"{_LOCAL_INSTEAD[alias]}: leave it out to run this file here", "local"))
    return errors


def pod_only_errors(run: TrainingRun) -> list[FieldError]:
    """The fields of a run set for its pods, which a local run could not honour (each named by its path)."""
    spec = run.spec
    pod = ("image", "resources", "node_selector", "tolerations")
    fleet = spec.eval.fleet if spec.eval is not None else None
    return [
        *_pod_only_errors("spec.trainer", spec.trainer, pod),
        *_pod_only_errors("spec.rollout.engine", spec.rollout.engine, (*pod, "port")),
        *_pod_only_errors("spec.rollout.router", spec.rollout.router, ("image", "port")),
        *_pod_only_errors("spec.eval.fleet.engine", fleet.engine if fleet else None, (*pod, "port"), EngineSpec),
        *_pod_only_errors("spec.eval.fleet.router", fleet.router if fleet else None, ("image", "port")),
        *_pod_only_errors("spec.weightSync", spec.weight_sync, ("mount_path",)),
        *_pod_only_errors("spec.weightSync.snapshotVolume", spec.weight_sync.snapshot_volume,
                          ("claim_name", "size", "storage_class_name")),
    ]


CLUSTER_LOCAL_PATH_MESSAGE = ("a directory of a local run (rlfleet run FILE); on Kubernetes the snapshots are on the "
                              "run's claim (claimName, or the one the operator creates), mounted at "
                              "spec.weightSync.mountPath: leave it out")


def cluster_run_errors(spec: TrainingRunSpec) -> list[FieldError]:
    """What a valid TrainingRun asks for that its pods on Kubernetes cannot do (each named by its field path)."""
    if spec.weight_sync.snapshot_volume.local_path is not None:
        return [FieldError("spec.weightSync.snapshotVolume.localPath", CLUSTER_LOCAL_PATH_MESSAGE, "kubernetes")]
    return []


def local_run_errors(run: TrainingRun) -> list[FieldError]:
    """What a valid TrainingRun asks for that a local run cannot do (each named by its field path)."""
    errors = [
        FieldError(format_path(loc + ("valueFrom",)), LOCAL_VALUE_FROM_MESSAGE, "local")
        for loc, model in _models_with_paths(run, ())
        if isinstance(model, EnvVarSpec) and model.value_from is not None
    ]
    trainer = run.spec.trainer
    if "max_restarts" in trainer.model_fields_set and trainer.max_restarts > 0:
        errors.append(FieldError("spec.trainer.maxRestarts", LOCAL_MAX_RESTARTS_MESSAGE, "local"))
    tracking = run.spec.tracking
    if tracking is not None and tracking.wandb is not None and tracking.wandb.api_key is not None:
        errors.append(FieldError("spec.tracking.wandb.apiKey", LOCAL_WANDB_API_KEY_MESSAGE, "local"))
    if trainer.nodes > 1:
        errors.append(FieldError("spec.trainer.nodes", f"{trainer.nodes}: a local run trains on this one machine; "
                                 "a trainer across nodes is a group of trainer pods on Kubernetes: set 1 (the ranks "
                                 "are tensorParallelSize x pipelineParallelSize x dataParallelSize)", "local"))
    return errors + pod_only_errors(run)
