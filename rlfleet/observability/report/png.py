"""The report's main panel (reward and eval score per step) as a PNG, for a terminal or a CI artifact."""
from __future__ import annotations

from pathlib import Path

from rlfleet.observability.report import svg
from rlfleet.observability.report.html import main_series
from rlfleet.observability.report.model import Report

SIZE = (svg.WIDTH, svg.HEIGHT)


def write_png(report: Report, path: Path) -> None:
    """Draw the main panel with PIL (same geometry as the SVG) and save it."""
    from PIL import Image, ImageDraw

    series = main_series(report)
    image = Image.new("RGB", SIZE, "white")
    draw = ImageDraw.Draw(image)
    x, x_ticks = svg._x_scale([*report.steps, *(s for pts in series.values() for s, _ in pts)])
    values = [v for pts in series.values() for _, v in pts] or [0.0, 1.0]
    lo, hi = min(0.0, min(values)), max(values)
    y_ticks = svg.nice_ticks(lo, hi if hi > lo else lo + 1)
    y = svg.Scale(y_ticks[0], y_ticks[-1], svg.HEIGHT - svg.BOTTOM, svg.TOP)
    draw.rectangle([svg.LEFT, svg.TOP, svg.WIDTH - svg.RIGHT, svg.HEIGHT - svg.BOTTOM], outline="#cccccc")
    for t in y_ticks:
        draw.line([svg.LEFT, y(t), svg.WIDTH - svg.RIGHT, y(t)], fill="#eeeeee")
        draw.text((4, y(t) - 6), f"{t:g}", fill="#333333")
    for t in x_ticks:
        draw.text((x(t) - 4, svg.HEIGHT - svg.BOTTOM + 6), f"{t:g}", fill="#333333")
    draw.text(((svg.LEFT + svg.WIDTH - svg.RIGHT) / 2 - 12, svg.HEIGHT - 16), "step", fill="#333333")
    for i, (name, points) in enumerate(series.items()):
        colour = svg.PALETTE[i % len(svg.PALETTE)]
        coords = [(x(s), y(v)) for s, v in points]
        if len(coords) > 1:
            draw.line(coords, fill=colour, width=2)
        for cx, cy in coords:
            draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=colour)
        ly = svg.TOP + 8 + i * 18
        draw.rectangle([svg.WIDTH - svg.RIGHT + 12, ly - 8, svg.WIDTH - svg.RIGHT + 22, ly + 2], fill=colour)
        draw.text((svg.WIDTH - svg.RIGHT + 28, ly - 8), name, fill="#333333")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
