"""The terminal's status line and the plain form (pure formatting)."""
from __future__ import annotations

import io

from rlfleet.orchestrator.run.progress import (
    ProgressReporter,
    ProgressState,
    engine_label,
    eta_seconds,
    format_status,
    startup_stage,
)


def test_bar_elapsed_and_eta():
    s = ProgressState(steps=10, step=4, reward=0.25, weight_version="4", engines_ready=2, engines_total=2,
                      samples_per_s=12.5, phase="train", started_at=0.0, phase_since=95.0,
                      training_since=60.0, first_step=0, engines={"0": "pinned v4", "1": "pinned v4"})
    line = format_status(s, now=100.0, width=200)
    assert line.startswith("step 4/10 [########------------]  40%")
    assert "elapsed 01:40 ETA 01:00" in line  # 40 s for 4 steps -> 6 more take 60 s
    assert "train 5 s | engines 2/2 0:pinned v4 1:pinned v4 | " in line
    assert line.endswith("reward 0.250 v4 12.5 samples/s")


def test_eta_counts_only_this_processes_steps():
    s = ProgressState(steps=20, step=12, training_since=0.0, first_step=10)
    assert eta_seconds(s, 10.0) == 40.0  # 2 steps in 10 s, 8 left
    assert eta_seconds(ProgressState(steps=20, step=10, training_since=0.0, first_step=10), 5.0) is None


def test_start_up_line_names_each_engine():
    s = ProgressState(steps=30, engines_total=2, phase="starting 2 engines", started_at=0.0, phase_since=4.0,
                      engines={"0": "loading", "1": "starting"})
    line = format_status(s, now=70.0, width=200)
    assert "ETA --:--" in line and "starting 2 engines 66 s" in line and "0:loading 1:starting" in line
    assert len(format_status(s, now=70.0, width=40)) == 40


def test_many_engines_are_counted():
    from rlfleet.orchestrator.run.progress import format_engines

    engines = {str(i): "pinned v3" for i in range(6)} | {"6": "loading", "7": "loading", "8": "dead"}
    assert format_engines(engines) == "6 pinned v3, 2 loading, 1 dead"
    assert format_engines({"10": "healthy", "2": "loading"}) == "2:loading 10:healthy"


def test_engine_stages():
    assert startup_stage(["[x] server_args=...", "[y] Load weight begin. avail mem=9 GB"]) == "loading"
    assert startup_stage(["UserWarning: ..."]) == "starting"
    assert engine_label("starting", "loading", None) == "loading"
    assert engine_label("alive", None, None) == "healthy"
    assert engine_label("alive", None, "3") == "pinned v3"
    assert engine_label("dead", None, None) == "dead"


def test_plain_output_is_one_line_per_event():
    out = io.StringIO()
    reporter = ProgressReporter(out, tty=False)
    state = ProgressState(steps=3)
    reporter.update(state)  # nothing: plain mode prints on events
    reporter.event("step 1/3 done", state)
    assert out.getvalue().count("\n") == 1 and "\r" not in out.getvalue()
    assert "step 0/3  reward -" in out.getvalue()


def test_terminal_redraws_in_place():
    out = io.StringIO()
    reporter = ProgressReporter(out, tty=True)
    state = ProgressState(steps=3)
    reporter.update(state)
    reporter.event("engine slot 0 marked dead", state)
    text = out.getvalue()
    assert text.startswith("\rstep 0/3 [") and "engine slot 0 marked dead" in text and text.count("\n") == 1


def test_a_trainer_of_several_ranks_is_shown_in_the_status_line_and_the_plain_form():
    from pathlib import Path

    from rlfleet.crds.loader import load_training_run
    from rlfleet.orchestrator.run.progress import format_progress
    from rlfleet.orchestrator.run.trainer_setup import ranks_label

    run = load_training_run(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
    run.spec.trainer = run.spec.trainer.model_copy(update={"backend": "megatron", "tensor_parallel_size": 2,
                                                           "data_parallel_size": 2})
    label = ranks_label(run.spec)
    assert label == "4 ranks tp2 pp1 dp2"
    s = ProgressState(steps=4, engines_total=2, trainer=label, started_at=0.0, phase_since=0.0)
    assert "| trainer 4 ranks tp2 pp1 dp2 | engines 0/2" in format_status(s, now=1.0, width=200)
    assert "trainer 4 ranks tp2 pp1 dp2  engines 0/2" in format_progress(s)
    assert "trainer" not in format_status(ProgressState(steps=4), now=1.0, width=200)  # one rank: nothing
