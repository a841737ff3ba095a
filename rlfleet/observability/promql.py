"""Which series a PromQL expression reads, and which series a registry exports.

Dashboards and alert rules are only as good as the names they query: a renamed metric leaves a panel
empty and an alert silent, and nothing complains. `selectors(expr)` lexes an expression (PromQL as
Prometheus and Grafana write it, Grafana variables included) and returns every series selector in it;
`exported_series(registry)` lists the series names a prometheus_client registry exposes, with their
label names, so a test can hold the two against each other.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.registry import Collector, CollectorRegistry

# Words that are never metric names where they stand.
KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                      "bool", "offset", "atan2", "inf", "nan"})
# Keywords followed by a parenthesised list of label names (optional after group_left/group_right).
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
# Functions whose argument must be a counter (a `_total`, or a histogram's `_bucket`/`_sum`/`_count`).
COUNTER_FUNCTIONS = frozenset({"rate", "irate", "increase", "resets"})
COUNTER_SUFFIXES = ("_total", "_bucket", "_sum", "_count")

_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+|\[\[\w+\]\])
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>@:,(){}\[\]])
""", re.VERBOSE)


class PromQLSyntaxError(ValueError):
    """The expression has something the lexer cannot read, or unbalanced brackets."""


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    pos: int


@dataclass(frozen=True)
class Selector:
    """One series selector: `metric{label=...}`, with the function it is passed to directly, if any."""

    metric: str
    labels: tuple[str, ...]  # label names in its matchers
    function: str | None  # e.g. "rate" for rate(metric[5m])


def tokens(expr: str) -> list[Token]:
    out: list[Token] = []
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise PromQLSyntaxError(f"cannot read {expr[pos:pos + 20]!r} at offset {pos} of {expr!r}")
        kind = match.lastgroup
        assert kind is not None, "every alternative of the token pattern is a named group"
        if kind != "space":
            out.append(Token(kind, match.group(), pos))
        pos = match.end()
    return out


def _closing(toks: list[Token], start: int) -> int:
    """Index of the bracket that closes toks[start]."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = [pairs[toks[start].text]]
    for i in range(start + 1, len(toks)):
        text = toks[i].text if toks[i].kind == "op" else ""
        if text in pairs:
            stack.append(pairs[text])
        elif text in (")", "]", "}"):
            if text != stack.pop():
                raise PromQLSyntaxError(f"unbalanced {text!r} at offset {toks[i].pos}")
            if not stack:
                return i
    raise PromQLSyntaxError(f"{toks[start].text!r} at offset {toks[start].pos} is never closed")


def _check_balanced(toks: list[Token]) -> None:
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack: list[Token] = []
    for tok in toks:
        if tok.kind != "op":
            continue
        if tok.text in pairs:
            stack.append(tok)
        elif tok.text in (")", "]", "}") and (not stack or pairs[stack.pop().text] != tok.text):
            raise PromQLSyntaxError(f"unbalanced {tok.text!r} at offset {tok.pos}")
    if stack:
        raise PromQLSyntaxError(f"{stack[-1].text!r} at offset {stack[-1].pos} is never closed")


def _matchers(toks: list[Token], start: int, end: int) -> tuple[tuple[str, ...], str | None]:
    """Label names in the matchers toks[start+1:end] (between braces), and a `__name__="x"` if any."""
    labels: list[str] = []
    name = None
    i = start + 1
    while i < end:
        tok = toks[i]
        if (tok.kind in ("ident", "string") and i + 2 < end and toks[i + 1].text in ("=", "!=", "=~", "!~")
                and toks[i + 2].kind == "string"):
            label = tok.text if tok.kind == "ident" else tok.text[1:-1]
            if label == "__name__" and toks[i + 1].text == "=":
                name = toks[i + 2].text[1:-1]
            else:
                labels.append(label)
            i += 3
        elif tok.text == ",":
            i += 1
        else:
            raise PromQLSyntaxError(f"unexpected {tok.text!r} in label matchers at offset {tok.pos}")
    return tuple(labels), name


def selectors(expr: str) -> list[Selector]:
    """Every series selector in `expr`, in order."""
    toks = tokens(expr)
    _check_balanced(toks)
    found: list[Selector] = []
    function_of: dict[int, str] = {}  # index of a token -> the function whose '(' it directly follows
    i = 0
    while i < len(toks):
        tok = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if tok.kind == "ident" and tok.text.lower() in KEYWORDS:
            if tok.text.lower() in LABEL_LIST_KEYWORDS and nxt is not None and nxt.text == "(":
                i = _closing(toks, i + 1) + 1
                continue
            i += 1
            continue
        if (tok.kind == "ident" and tok.text in AGGREGATIONS and nxt is not None
                and nxt.text in ("by", "without")):  # sum by (x) (expr): the grouping comes first
            after = _closing(toks, i + 2) + 1 if i + 2 < len(toks) and toks[i + 2].text == "(" else len(toks)
            if after >= len(toks) or toks[after].text != "(":
                raise PromQLSyntaxError(f"{tok.text} {nxt.text} at offset {tok.pos} needs (labels) (expression)")
            function_of[after + 1] = tok.text
            i = after + 1
            continue
        if tok.kind == "ident" and nxt is not None and nxt.text == "(":
            function_of[i + 2] = tok.text
            i += 2
            continue
        if tok.kind == "ident":
            labels: tuple[str, ...] = ()
            end = i
            if nxt is not None and nxt.text == "{":
                end = _closing(toks, i + 1)
                labels, _ = _matchers(toks, i + 1, end)
            found.append(Selector(tok.text, labels, function_of.get(i)))
            i = end + 1
            continue
        if tok.text == "{":  # a selector by matchers alone: {__name__="x", ...}
            end = _closing(toks, i)
            labels, name = _matchers(toks, i, end)
            if name is None:
                raise PromQLSyntaxError(f"selector without a metric name at offset {tok.pos} of {expr!r}")
            found.append(Selector(name, labels, function_of.get(i)))
            i = end + 1
            continue
        if tok.text == "[":  # range or subquery: durations and Grafana variables only
            i = _closing(toks, i) + 1
            continue
        i += 1
    return found


# --- what a registry exports ------------------------------------------------------------------------

_SERIES_SUFFIXES = {
    "counter": (("_total", ()), ("_created", ())),
    "gauge": (("", ()),),
    "histogram": (("_bucket", ("le",)), ("_sum", ()), ("_count", ()), ("_created", ())),
    "gaugehistogram": (("_bucket", ("le",)), ("_gsum", ()), ("_gcount", ())),
    "summary": (("", ("quantile",)), ("_sum", ()), ("_count", ()), ("_created", ())),
    "info": (("_info", ()),),
    "stateset": (("", ()),),
    "unknown": (("", ()),),
}


def exported_series(registry: CollectorRegistry) -> dict[str, frozenset[str]]:
    """Series name -> label names, for every series the registry's collectors can expose.

    Names come from each family's type as prometheus_client exposes it (a Counter `x_total` is the
    series `x_total`; a Histogram `x` is `x_bucket`, `x_sum`, `x_count`), so a labelled metric that
    has no child yet is listed too.
    """
    out: dict[str, frozenset[str]] = {}
    for collector in _collectors(registry):
        label_names = tuple(getattr(collector, "_labelnames", ()))
        describe = getattr(collector, "describe", None)
        families = describe() if describe is not None else []
        if not families:
            families = list(collector.collect())
        for family in families:
            for suffix, extra in _SERIES_SUFFIXES.get(family.type, (("", ()),)):
                out[family.name + suffix] = frozenset(label_names + extra)
            for sample in getattr(family, "samples", ()):  # custom collectors: take what they emit
                out.setdefault(sample.name, frozenset(sample.labels))
    return out


def _collectors(registry: CollectorRegistry) -> Iterator[Collector]:
    # The registry keeps its collectors in a private map; it has no public list of them.
    with registry._lock:
        collectors = list(registry._collector_to_names)
    yield from collectors
