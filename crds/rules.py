"""Cross-field rules, written once: a CEL expression for the API server and a Python predicate.

Each rule is declared on the model it constrains (`cel_rules` class attribute). The CRD generator
emits it as an `x-kubernetes-validations` entry on that model's schema; pydantic validation of the
model runs the Python predicate, so the local loader rejects what the API server rejects, with the
same message at the same field path.

Transition rules (`transition=True`) compare a stored object with its update (`self` vs `oldSelf` in
CEL, `(new, old)` in Python). They hold only on updates, so the API server checks them on every
`kubectl apply` of an existing object and the Python side checks them in `loader.validate_update`.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import AfterValidator, BaseModel
from pydantic_core import PydanticCustomError

# The pydantic error type the loader recognises as a violated rule.
RULE_ERROR_TYPE = "rlfleet_rule"


@dataclass(frozen=True)
class Rule:
    """One cross-field rule on the object it is declared on.

    cel:     CEL with `self` bound to the object (and `oldSelf` to the stored one for transitions).
    check:   the same rule in Python: `check(obj)`, or `check(new, old)` for transitions; True = valid.
    field:   the field the message is about, relative to the object, camelCase, dotted ("" = itself).
    message: what is wrong, naming the rule in words a user understands.
    detail:  (optional) the message with the object's numbers in it, for the loader (a function of the
             object). The API server says `message`: a CEL messageExpression that formats numbers
             (`string(int)`) is refused by its cost estimate.
    """

    cel: str
    check: Callable[..., bool]
    field: str
    message: str
    transition: bool = False
    detail: Callable[[Any], str] | None = None

    def message_for(self, obj: Any) -> str:
        """What a violation of this rule by `obj` says (the detailed message when there is one)."""
        return self.detail(obj) if self.detail is not None else self.message

    def field_path(self) -> str:
        """The CRD `fieldPath` form: a relative JSON path such as `.resumeAtC`."""
        return "." + self.field if self.field else ""

    def to_validation(self) -> dict[str, Any]:
        """The `x-kubernetes-validations` entry."""
        entry: dict[str, Any] = {"rule": self.cel, "message": self.message}
        if self.field:
            entry["fieldPath"] = self.field_path()
            entry["reason"] = "FieldValueInvalid"
        return entry


def _unchanged_cel(field: str) -> str:
    """CEL: `field` is absent in both versions, or present in both with equal values."""
    return f"has(self.{field}) == has(oldSelf.{field}) && (!has(self.{field}) || self.{field} == oldSelf.{field})"


def immutable(field: str, attribute: str, what: str | None = None, *, message: str | None = None) -> Rule:
    """A transition rule: `field` (camelCase; python `attribute`) may not change once set.

    Absent-to-absent is allowed; any other change (set, unset, new value) is rejected.
    """
    return Rule(
        cel=_unchanged_cel(field),
        check=lambda new, old: getattr(new, attribute) == getattr(old, attribute),
        field=field,
        message=message or f"{what or field} is immutable once the object exists",
        transition=True,
    )


def only_when(field: str, attribute: str, default: Any, *, when_cel: str, when: Callable[[Any], bool],
              message: str) -> Rule:
    """`field` (camelCase; python `attribute`) takes effect only when `when` holds; otherwise it must be left
    at `default`, or it would be accepted and ignored. `default` None: left unset."""
    if default is None:
        kept_cel, kept = f"!has(self.{field})", (lambda s: getattr(s, attribute) is None)
    else:
        literal = ("true" if default else "false") if isinstance(default, bool) else (
            f"'{default}'" if isinstance(default, str) else repr(default))  # an int field compares with an int
        kept_cel, kept = f"self.{field} == {literal}", (lambda s: getattr(s, attribute) == default)
    return Rule(cel=f"({when_cel}) || {kept_cel}", check=lambda s: when(s) or kept(s), field=field,
                message=message)


def fixed_except(model_cls: type[BaseModel], keep: Collection[str], *, message: str) -> Rule:
    """A transition rule: every field of `model_cls` but those in `keep` (python names) may not change.

    One rule for the whole object, so a CEL budget is spent once and the message says what stays open.
    """
    fields = [(name, info.alias or name) for name, info in model_cls.model_fields.items() if name not in keep]
    return Rule(
        cel=" && ".join(f"({_unchanged_cel(alias)})" for _, alias in fields),
        check=lambda new, old: all(getattr(new, name) == getattr(old, name) for name, _ in fields),
        field="",
        message=message,
        transition=True,
    )


@dataclass(frozen=True)
class Violation:
    """A broken rule, located relative to the object the rule is declared on."""

    field: str
    message: str
    rule: str


def object_rules(model_cls: type[BaseModel]) -> tuple[Rule, ...]:
    return tuple(getattr(model_cls, "cel_rules", ()))


def check_object(obj: BaseModel) -> list[Violation]:
    """The non-transition rules of one object (not its children) that `obj` breaks."""
    return [
        Violation(rule.field, rule.message_for(obj), rule.cel)
        for rule in object_rules(type(obj))
        if not rule.transition and not rule.check(obj)
    ]


def raise_violations(obj: BaseModel) -> None:
    """Pydantic hook: one error carrying every violation of this object (the loader splits them)."""
    violations = check_object(obj)
    if violations:
        raise PydanticCustomError(
            RULE_ERROR_TYPE,
            "{summary}",
            {
                "summary": "; ".join(f"{v.field or 'object'}: {v.message}" for v in violations),
                "violations": violations,
            },
        )


def _walk_pairs(new: Any, old: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], BaseModel, BaseModel]]:
    """Objects present at the same path in both versions.

    Lists are not descended into: the API server does not correlate items of atomic lists, so
    transition rules are declared only on objects outside lists.
    """
    if isinstance(new, BaseModel) and isinstance(old, BaseModel) and type(new) is type(old):
        yield path, new, old
        for name, info in type(new).model_fields.items():
            yield from _walk_pairs(getattr(new, name), getattr(old, name), path + (info.alias or name,))


def check_transition(new: BaseModel, old: BaseModel) -> list[tuple[tuple[str, ...], Violation]]:
    """Transition-rule violations of an update, each with the path of the object it is declared on."""
    found = []
    for path, a, b in _walk_pairs(new, old, ()):
        for rule in object_rules(type(a)):
            if rule.transition and not rule.check(a, b):
                found.append((path, Violation(rule.field, rule.message, rule.cel)))
    return found


def value_rule(cel: str, check: Callable[[Any], bool], message: str) -> tuple[Any, Any]:
    """A rule on a single value (a list item, a map value): CEL with `self` bound to the value.

    Returns the two `Annotated` metadata items: the CRD schema entry and the Python check, which
    reports the value's own path (e.g. `extraArgs[2]`) as the API server does.
    """
    def validate(value: Any) -> Any:
        if not check(value):
            raise PydanticCustomError(
                RULE_ERROR_TYPE, "{summary}", {"summary": message, "violations": [Violation("", message, cel)]}
            )
        return value

    return (
        _ValueRuleSchema(cel, message),
        AfterValidator(validate),
    )


@dataclass(frozen=True)
class _ValueRuleSchema:
    """The `x-kubernetes-validations` entry of a value rule, added to the value's JSON schema."""

    cel: str
    message: str

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler(core_schema)
        schema.setdefault("x-kubernetes-validations", []).append({"rule": self.cel, "message": self.message})
        return schema
