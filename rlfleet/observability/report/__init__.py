"""`rlfleet report RUN`: a self-contained HTML page of a run (plots as inline SVG) and a PNG of its main panel."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.observability.report import html, model, png

SUMMARY_NAMES = ("summary.json",)


class ReportError(ValueError):
    """The run directory has no summary, or the summary is not a run summary."""


@dataclass(frozen=True)
class Written:
    html: Path
    png: Path


def find_summary(run: Path) -> Path:
    """The summary JSON of `run`: the file itself, or the one summary in the directory."""
    if run.is_file():
        return run
    if not run.is_dir():
        raise ReportError(f"{run}: no such file or directory")
    found = [run / n for n in SUMMARY_NAMES if (run / n).is_file()] or sorted(run.glob("*summary*.json"))
    if len(found) != 1:
        what = "no summary JSON" if not found else f"{len(found)} summaries ({', '.join(p.name for p in found)})"
        raise ReportError(f"{run}: {what}; name the summary file")
    return found[0]


def load_summary(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}: cannot read the summary: {exc}") from None
    if not isinstance(data, dict) or "steps_planned" not in data:
        raise ReportError(f"{path}: not a run summary (no steps_planned)")
    return data


def write_report(data: dict[str, Any], html_path: Path, *, title: str = "rlfleet run") -> Written:
    """Write the HTML page and, beside it (same name, .png), the main panel."""
    report = model.from_summary(data, title=title)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(html.render(report))
    png_path = html_path.with_suffix(".png")
    png.write_png(report, png_path)
    return Written(html_path, png_path)


def report_path_for(summary: Path) -> Path:
    """Where the report of a summary goes: beside it, `<name>-report.html`."""
    return summary.with_name(f"{summary.stem}-report.html")
