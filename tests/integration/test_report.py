"""`rlfleet report` opened in a real browser: headless Chromium draws the page, and its DOM carries the
summary's numbers.

The summary is tests/data/quickstart-summary.json, written by a real `rlfleet run --chaos --chaos-interval 30`
of examples/quickstart.yaml with `steps: 10` and eval `intervalSteps: 5` (435 s on a 2-core machine: 7 engines
SIGKILLed and marked dead, 6 recreated, 3 eval points), committed so the test needs no engines.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

SUMMARY = Path(__file__).resolve().parents[1] / "data" / "quickstart-summary.json"
WINDOW = (1000, 2400)

pytestmark = pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (scripts/setup.sh)")


class Marks(HTMLParser):
    """Every element with a class, by tag, with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, {k: v or "" for k, v in attrs}))

    def of(self, cls: str, **attrs: str) -> list[dict[str, str]]:
        return [a for _, a in self.found if cls in a.get("class", "").split()
                and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    summary = out / "summary.json"
    shutil.copy(SUMMARY, summary)
    proc = subprocess.run([sys.executable, "-P", "-m", "rlfleet.cli", "report", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    html = out / "summary-report.html"
    assert f"rlfleet report: {html} (main panel {out / 'summary-report.png'})" in proc.stdout
    # One browser start: the screenshot, and the DOM as the browser built it.
    dom = _chromium(f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={out / 'shot.png'}", "--dump-dom",
                    html.as_uri()).stdout
    marks = Marks()
    marks.feed(dom)
    return {"data": json.loads(SUMMARY.read_text()), "marks": marks, "shot": out / "shot.png",
            "png": out / "summary-report.png", "html": html}


def test_the_summary_is_a_real_runs_with_eval_and_a_recreated_engine(page):
    data = page["data"]
    assert data["steps_completed"] == data["steps_planned"] >= 5
    assert [p for p in data["eval"] if not p["skipped"]], "eval scored at least one point"
    assert data["recovered_slots_per_step"], "the chaos kill recreated an engine"


def test_every_plot_is_in_the_page_and_drawn(page):
    marks = page["marks"]
    plots = {a["id"] for a in marks.of("plot")}
    assert plots == {"plot-reward", "plot-step-time", "plot-events", "plot-versions"}
    assert "<script" not in page["html"].read_text(), "self-contained: no script"
    shot = Image.open(page["shot"]).convert("RGB")
    assert shot.size == WINDOW
    colours = shot.getcolors(maxcolors=1 << 20) or []
    drawn = sum(n for n, c in colours if c == (0x1F, 0x77, 0xB4))  # the reward line's colour
    assert drawn > 500, f"{drawn} pixels of the reward plot's colour in the screenshot"


def test_reward_and_eval_points_carry_the_summary_numbers(page):
    data, marks = page["data"], page["marks"]
    steps = sorted(int(s) for s in data["weight_versions_per_step"])
    reward = {int(a["data-step"]): float(a["data-value"]) for a in marks.of("point", data_series="reward mean")}
    assert reward == dict(zip(steps, data["reward_mean_per_step"], strict=True))
    for point in data["eval"]:
        for dataset, score in point["scores"].items():
            shown = marks.of("point", data_series=f"eval {dataset}", data_step=str(point["step"]))
            assert [float(a["data-value"]) for a in shown] == [score], (point, shown)


def test_step_time_bars_add_up_to_each_steps_sync_seconds(page):
    data, marks = page["data"], page["marks"]
    for step, sync in data["weight_sync_per_step"].items():
        bars = marks.of("bar", data_step=step)
        assert {a["data-part"] for a in bars} >= {f"sync {p}" for p in sync["phases"]}, step
        assert sum(float(a["data-seconds"]) for a in bars) == pytest.approx(sync["seconds"], abs=1e-3), step


def test_engine_events_and_weight_versions_per_step(page):
    data, marks = page["data"], page["marks"]
    recreated = sorted((int(step), str(slot)) for step, slots in data["recovered_slots_per_step"].items()
                       for slot in slots)
    shown = sorted((int(a["data-step"]), a["data-slot"]) for a in marks.of("event", data_kind="engine_recreated"))
    assert shown == recreated
    for step, versions in data["weight_versions_per_step"].items():
        trained = sorted(a["data-version"] for a in marks.of("version", data_source="samples", data_step=step))
        assert trained == sorted(versions), step
    for step, engines in data["engine_versions_per_step"].items():
        served = {a["data-slot"]: a["data-version"] for a in marks.of("version", data_source="engine", data_step=step)}
        assert served == engines, step


def test_the_png_is_the_main_panel(page):
    from rlfleet.observability.report import png

    image = Image.open(page["png"])
    assert image.format == "PNG" and image.size == png.SIZE
    colours = image.convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert sum(n for n, c in colours if c == (0x1F, 0x77, 0xB4)) > 100, "the reward line is drawn"
