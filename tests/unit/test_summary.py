from rlfleet.orchestrator.run.summary import RunSummary, StepRecord, reward_means_first_last


def test_first_and_last_ten_percent():
    steps = [StepRecord(i, float(i), [str(i)], 1.0, 4) for i in range(1, 21)]
    # 20 steps: first 2 (1, 2) and last 2 (19, 20)
    assert reward_means_first_last(steps) == (1.5, 19.5)


def test_short_runs_use_one_step_each_side():
    steps = [StepRecord(1, 0.25, ["0"], 1.0, 4), StepRecord(2, 0.75, ["1"], 1.0, 4)]
    assert reward_means_first_last(steps) == (0.25, 0.75)
    assert reward_means_first_last([]) == (None, None)


def test_summary_keys_and_versions(tmp_path):
    summary = RunSummary(steps_planned=3, steps=[StepRecord(1, 0.5, ["0", "0", "1"], 2.0, 3),
                                                 StepRecord(2, 0.5, ["1"], 9.0, 3, heat_paused=True)],
                         engines_marked_dead=1, engines_recreated=1, wall_seconds=12.3456)
    out = tmp_path / "s.json"
    summary.write(out)
    import json

    data = json.loads(out.read_text())
    assert data["steps_completed"] == 2 and data["steps_planned"] == 3
    assert data["weight_versions_per_step"] == {"1": ["0", "1"], "2": ["1"]}
    assert data["heat_paused_per_step"] == {"1": False, "2": True}
    assert data["engines_marked_dead"] == 1 and data["engines_recreated"] == 1
    assert data["wall_seconds"] == 12.346 and data["eval"] == []


def test_weight_sync_per_step_and_fallbacks():
    steps = [StepRecord(1, 0.1, ["0"], 2.0, 4, sync={"mode": "broadcast", "seconds": 0.05, "fallback": None}),
             StepRecord(2, 0.2, ["1"], 3.0, 4, sync={"mode": "broadcast_fallback", "seconds": 1.5,
                                                     "fallback": "transfer: bucket 1/1: slot 1: wedged"}),
             StepRecord(3, 0.3, ["2"], 2.0, 4)]
    data = RunSummary(steps_planned=3, steps=steps).to_dict()
    assert data["weight_sync_per_step"] == {"1": steps[0].sync, "2": steps[1].sync}
    assert data["weight_sync_fallbacks"] == 1


def test_per_step_record_and_its_series():
    from rlfleet.orchestrator.run.summary import RunEvent, reward_std, scalars, staleness_of

    rewards = [0.0, 1.0, 1.0, 0.0]
    record = StepRecord(3, 0.5, ["2", "2", "1", "0"], 2.5, 4, loss=0.125, reward_std=reward_std(rewards),
                        kl_ref=0.01, clip_fraction=0.25, grad_norm=1.5, response_length_mean=6.0, tokens=24,
                        staleness=staleness_of(["2", "2", "1", "0"], 2), stale_groups_dropped=1,
                        samples_per_s=1.6, tokens_per_s=9.6,
                        phases={"rollout_wait": 1.0, "train": 0.5, "export": 0.25, "weight_sync": 0.5,
                                "eval_held": 0.0},
                        ended_at=30.0)
    summary = RunSummary(steps_planned=3, steps=[record],
                         events=[RunEvent("engine_dead", 3, 12.0, "1", "exit: SIGKILL"),
                                 RunEvent("engine_recreated", 3, 20.0, "1")],
                         eval=[{"step": 3, "scores": {"reverse": 0.5}, "seconds": 2.0, "skipped": None},
                               {"step": 2, "scores": {}, "seconds": None, "skipped": "busy"}])
    data = summary.to_dict()
    (rec,) = data["records"]
    assert rec["reward_std"] == 0.5 and rec["staleness"] == {"0": 2, "1": 1, "2": 1}
    assert rec["weight_versions"] == {"0": 1, "1": 1, "2": 2}
    assert rec["phases"] == {"rollout_wait": 1.0, "train": 0.5, "export": 0.25, "weight_sync": 0.5, "eval_held": 0.0}
    assert data["event_counts"]["engine_dead"] == 1 and data["event_counts"]["watchdog_strike"] == 0
    assert data["events"][0] == {"kind": "engine_dead", "step": 3, "at": 12.0, "slot": "1", "detail": "exit: SIGKILL"}
    assert data["eval_skips"] == {"busy": 1}
    series = scalars(rec)
    assert series["train/reward_mean"] == 0.5 and series["time/weight_sync"] == 0.5
    assert series["staleness/0"] == 2.0 and "train/kl_ref" in series
    assert scalars({**rec, "kl_ref": None}).get("train/kl_ref") is None


def test_step_line_phases():
    from rlfleet.orchestrator.run.summary import format_phases

    text = format_phases({"rollout_wait": 1.234, "train": 0.5, "export": 0.001, "weight_sync": 0.05})
    assert text == "rollout 1.23 s, train 0.50 s, sync 0.05 s"
    # A batch that was already waiting still shows its rollout wait (the step line's shape never changes).
    assert format_phases({"rollout_wait": 0.001, "train": 0.5, "weight_sync": 0.05}) == \
        "rollout 0.00 s, train 0.50 s, sync 0.05 s"


def test_record_survives_a_checkpoint():
    import json

    from rlfleet.orchestrator.run.checkpointing import restore_summary, summary_state
    from rlfleet.orchestrator.run.summary import RunEvent

    summary = RunSummary(steps_planned=4, steps=[StepRecord(1, 0.5, ["0"], 1.0, 1, engine_versions={0: "1"},
                                                            staleness={"1": 1}, phases={"train": 0.5})],
                         events=[RunEvent("heat_pause", 1, 3.0, "0", "hot")])
    state = json.loads(json.dumps(summary_state(summary, 0)))
    again = RunSummary(steps_planned=4)
    restore_summary(again, state)
    assert again.to_dict()["records"] == summary.to_dict()["records"]
    assert again.events == summary.events


async def test_a_run_ended_by_an_unexpected_error_says_it_in_its_summary(tmp_path):
    """Not a RunError (a bug, an error nobody classified): raised as it is, and the summary written for the
    run's report still says what ended it."""
    import json

    import pytest

    from rlfleet.crds.loader import load_text
    from rlfleet.orchestrator.run.local import LocalRun, RunOptions

    (doc,) = load_text("apiVersion: rlfleet.io/v1alpha1\nkind: TrainingRun\nmetadata: {name: r}\n"
                       "spec: {modelPath: 'tiny://llama', rollout: {engine: {device: cpu}}, trainer: {gpus: 0}}\n")
    not_a_directory = tmp_path / "run"
    not_a_directory.write_text("")
    local = LocalRun(doc.obj, RunOptions(run_dir=not_a_directory, summary_path=tmp_path / "summary.json"))
    with pytest.raises(FileExistsError):
        await local.execute()
    failure = json.loads((tmp_path / "summary.json").read_text())["failure"]
    assert failure.startswith("FileExistsError: "), failure
