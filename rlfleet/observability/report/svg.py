"""Plots as inline SVG (pure: data in, markup out). Every mark carries its numbers in data-* attributes."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from rlfleet.observability.report.model import Event

WIDTH, HEIGHT = 820, 280
LEFT, RIGHT, TOP, BOTTOM = 60, 170, 14, 40  # margins; the legend sits in the right one
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
EVENT_COLOURS = {"engine_dead": "#d62728", "engine_recreated": "#2ca02c", "heat_pause": "#ff7f0e",
                 "heat_resume": "#bcbd22", "watchdog_strike": "#9467bd", "sync_fallback": "#8c564b",
                 "checkpoint": "#1f77b4", "resumed": "#17becf", "router_event": "#e377c2",
                 "fleet_resized": "#7f7f7f"}


@dataclass(frozen=True)
class Scale:
    lo: float
    hi: float
    a: float  # pixel of lo
    b: float  # pixel of hi

    def __call__(self, value: float) -> float:
        span = self.hi - self.lo
        return self.a + (value - self.lo) / span * (self.b - self.a) if span else (self.a + self.b) / 2


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    value = math.floor(lo / step) * step
    ticks = [round(value, 10)]
    while value < hi - step * 1e-9:  # the last tick is at or above hi: every mark fits
        value += step
        ticks.append(round(value, 10))
    return ticks


def _fmt(value: float) -> str:
    return f"{value:g}"


def _frame(plot_id: str, label: str, x: Scale, y: Scale, x_ticks: Sequence[float], y_ticks: Sequence[float],
           x_label: str, y_label: str) -> list[str]:
    out = [f'<svg id="{plot_id}" class="plot" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(label)}">',
           f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
           'fill="#fff" stroke="#ccc"/>']
    for t in x_ticks:
        px = x(t)
        out.append(f'<line x1="{px:.1f}" y1="{HEIGHT - BOTTOM}" x2="{px:.1f}" y2="{HEIGHT - BOTTOM + 4}" '
                   'stroke="#888"/>'
                   f'<text class="tick" x="{px:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{_fmt(t)}</text>')
    for t in y_ticks:
        py = y(t)
        out.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{WIDTH - RIGHT}" y2="{py:.1f}" stroke="#eee"/>'
                   f'<text class="tick" x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    out.append(f'<text class="axis" x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    out.append(f'<text class="axis" x="14" y="{(TOP + HEIGHT - BOTTOM) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(TOP + HEIGHT - BOTTOM) / 2})">{escape(y_label)}</text>')
    return out


def _legend(names: Sequence[str], colours: Sequence[str]) -> list[str]:
    out = []
    for i, (name, colour) in enumerate(zip(names, colours, strict=True)):
        y = TOP + 8 + i * 18
        out.append(f'<g class="legend-item" data-series="{escape(name)}"><rect x="{WIDTH - RIGHT + 12}" y="{y - 8}" '
                   f'width="10" height="10" fill="{colour}"/><text x="{WIDTH - RIGHT + 28}" y="{y + 1}">'
                   f'{escape(name)}</text></g>')
    return out


def _x_scale(steps: Sequence[int]) -> tuple[Scale, list[float]]:
    lo, hi = (min(steps), max(steps)) if steps else (0, 1)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    return Scale(lo - 0.5, hi + 0.5, LEFT, WIDTH - RIGHT), [t for t in nice_ticks(lo, hi)
                                                           if float(t).is_integer() and lo <= t <= hi]


def line_chart(plot_id: str, label: str, series: dict[str, list[tuple[int, float]]], *, x_label: str = "step",
               y_label: str = "", steps: Sequence[int] = ()) -> str:
    """One polyline and one point per value of each series; a point's data-step/data-value are its numbers."""
    x, x_ticks = _x_scale([*steps, *(s for pts in series.values() for s, _ in pts)])
    values = [v for pts in series.values() for _, v in pts] or [0.0, 1.0]
    lo, hi = min(0.0, min(values)), max(values)
    y_ticks = nice_ticks(lo, hi if hi > lo else lo + 1)
    y = Scale(y_ticks[0], y_ticks[-1], HEIGHT - BOTTOM, TOP)
    out = _frame(plot_id, label, x, y, x_ticks, y_ticks, x_label, y_label)
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    for (name, points), colour in zip(series.items(), colours, strict=True):
        path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        out.append(f'<g class="series" data-series="{escape(name)}">'
                   f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for s, v in points:
            out.append(f'<circle class="point" data-series="{escape(name)}" data-step="{s}" data-value="{v!r}" '
                       f'cx="{x(s):.1f}" cy="{y(v):.1f}" r="3.5" fill="{colour}">'
                       f'<title>{escape(name)} step {s}: {v:.4g}</title></circle>')
        out.append("</g>")
    out += _legend(list(series), colours)
    out.append("</svg>")
    return "\n".join(out)


def stacked_bars(plot_id: str, label: str, rows: list[tuple[int, dict[str, float]]], parts: Sequence[str], *,
                 y_label: str = "seconds", steps: Sequence[int] = ()) -> str:
    """One bar per step, one segment per part (stacked in `parts` order); data-seconds is the segment's."""
    x, x_ticks = _x_scale([*steps, *(s for s, _ in rows)])
    totals = [sum(t.values()) for _, t in rows] or [1.0]
    y_ticks = nice_ticks(0.0, max(totals) or 1.0)
    y = Scale(0.0, y_ticks[-1], HEIGHT - BOTTOM, TOP)
    out = _frame(plot_id, label, x, y, x_ticks, y_ticks, "step", y_label)
    colours = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(parts)}
    width = max(2.0, min(40.0, (x(1) - x(0)) * 0.7))
    for step, times in rows:
        base = 0.0
        out.append(f'<g class="bar-stack" data-step="{step}" data-total="{sum(times.values())!r}">')
        for part in parts:
            if part not in times:
                continue
            seconds = times[part]
            top, bottom = y(base + seconds), y(base)
            out.append(f'<rect class="bar" data-step="{step}" data-part="{escape(part)}" data-seconds="{seconds!r}" '
                       f'x="{x(step) - width / 2:.1f}" y="{top:.1f}" width="{width:.1f}" '
                       f'height="{max(0.0, bottom - top):.1f}" fill="{colours[part]}">'
                       f'<title>step {step} {escape(part)}: {seconds:.3f} s</title></rect>')
            base += seconds
        out.append("</g>")
    out += _legend(list(parts), [colours[p] for p in parts])
    out.append("</svg>")
    return "\n".join(out)


def timeline(plot_id: str, label: str, events: list[Event], *, steps: Sequence[int] = ()) -> str:
    """One lane per event kind; a marker per event at its step (data-step, data-kind, data-slot)."""
    kinds = sorted({e.kind for e in events}) or ["(none)"]
    x, x_ticks = _x_scale([*steps, *(e.step for e in events)])
    lane = (HEIGHT - TOP - BOTTOM) / len(kinds)
    y = Scale(0, len(kinds), TOP, HEIGHT - BOTTOM)
    out = _frame(plot_id, label, x, y, x_ticks, [], "step", "")
    for i, kind in enumerate(kinds):
        out.append(f'<text class="lane" x="{LEFT + 4}" y="{TOP + lane * i + 12:.1f}">{escape(kind)}</text>')
    for event in events:
        i = kinds.index(event.kind)
        cy = TOP + lane * i + lane / 2 + 4
        colour = EVENT_COLOURS.get(event.kind, "#333")
        slot = "" if event.slot is None else f' data-slot="{escape(event.slot)}"'
        text = f"step {event.step} {event.kind}" + (f" slot {event.slot}" if event.slot is not None else "")
        text += f": {event.detail}" if event.detail else ""
        out.append(f'<g class="event" data-step="{event.step}" data-kind="{escape(event.kind)}"{slot}>'
                   f'<path d="M{x(event.step):.1f},{cy - 7:.1f} l7,7 l-7,7 l-7,-7 z" fill="{colour}"/>'
                   f'<title>{escape(text)}</title></g>')
    out.append("</svg>")
    return "\n".join(out)


def version_chart(plot_id: str, label: str, samples: list[tuple[int, list[str]]],
                  engines: list[tuple[int, dict[str, str]]], *, steps: Sequence[int] = ()) -> str:
    """Per step: the weight versions its samples came from (circles) and each engine's read-back (squares)."""
    def number(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:
            return None

    numbers = [n for _, vs in samples for v in vs if (n := number(v)) is not None]
    numbers += [n for _, es in engines for v in es.values() if (n := number(v)) is not None]
    x, x_ticks = _x_scale([*steps, *(s for s, _ in samples), *(s for s, _ in engines)])
    hi = max(numbers, default=1.0)
    y_ticks = [t for t in nice_ticks(0.0, hi if hi > 0 else 1.0) if float(t).is_integer()]
    y = Scale(y_ticks[0], y_ticks[-1], HEIGHT - BOTTOM, TOP)
    out = _frame(plot_id, label, x, y, x_ticks, y_ticks, "step", "weight version")
    for step, versions in samples:
        for v in versions:
            n = number(v)
            if n is not None:
                out.append(f'<circle class="version" data-source="samples" data-step="{step}" '
                           f'data-version="{escape(v)}" cx="{x(step) - 4:.1f}" cy="{y(n):.1f}" r="4" '
                           f'fill="{PALETTE[0]}"><title>step {step} trained on version {escape(v)}</title></circle>')
    for step, slots in engines:
        for slot, v in sorted(slots.items()):
            n = number(v)
            if n is not None:
                out.append(f'<rect class="version" data-source="engine" data-slot="{escape(slot)}" '
                           f'data-step="{step}" data-version="{escape(v)}" x="{x(step) + 1:.1f}" '
                           f'y="{y(n) - 3.5:.1f}" width="7" height="7" fill="{PALETTE[1]}">'
                           f'<title>step {step} engine {escape(slot)} serves {escape(v)}</title></rect>')
    out += _legend(["samples trained on", "engines read back"], [PALETTE[0], PALETTE[1]])
    out.append("</svg>")
    return "\n".join(out)
