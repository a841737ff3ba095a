"""The run report as one self-contained HTML page (inline CSS and SVG; no script, nothing fetched)."""
from __future__ import annotations

from html import escape

from rlfleet.observability.report import svg
from rlfleet.observability.report.model import Report

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1000px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; } td, th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
svg.plot text { font: 11px system-ui, sans-serif; fill: #333; }
.note { color: #666; }
"""


def main_series(report: Report) -> dict[str, list[tuple[int, float]]]:
    """The main panel's lines: the mean reward per step and each eval dataset's score at its step."""
    return {"reward mean": report.reward, **{f"eval {name}": points for name, points in report.eval_scores.items()}}


def render(report: Report) -> str:
    steps = report.steps
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(report.title)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>{escape(report.title)}</h1>",
             '<table id="facts">' + "".join(
                 f'<tr><th>{escape(k)}</th><td data-fact="{escape(k)}">{escape(v)}</td></tr>' for k, v in report.facts)
             + "</table>",
             "<h2>Reward and eval score per step</h2>",
             svg.line_chart("plot-reward", "reward and eval score per step", main_series(report),
                            y_label="reward / score", steps=steps)]
    if report.eval_skips:
        skips = ", ".join(f"step {s} ({escape(r)})" for s, r in report.eval_skips)
        parts.append(f'<p class="note" id="eval-skips">eval skipped: {skips}</p>')
    parts += [f"<h2>Step time breakdown ({escape(report.time_source)})</h2>",
              svg.stacked_bars("plot-step-time", f"step time breakdown ({report.time_source})", report.step_times,
                               report.time_parts, steps=steps),
              "<h2>Engine events</h2>",
              svg.timeline("plot-events", "engine events per step", report.events, steps=steps)]
    if not report.events:
        parts.append('<p class="note">no engine event in this run</p>')
    if report.router_events:
        parts.append('<ul id="router-events">' + "".join(f"<li>{escape(e)}</li>" for e in report.router_events)
                     + "</ul>")
    parts += ["<h2>Weight versions per step</h2>",
              svg.version_chart("plot-versions", "weight versions per step", report.weight_versions,
                                report.engine_versions, steps=steps),
              "</body></html>\n"]
    return "\n".join(parts)
