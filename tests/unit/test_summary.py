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
