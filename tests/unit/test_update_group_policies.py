"""A broadcast run's update-group NetworkPolicies converge: created, restored after an edit, deleted when
no longer wanted (the operator's policies switched off, the run out of broadcast mode). Pure."""
from __future__ import annotations

import copy

from rlfleet.operator import builders as b
from rlfleet.operator.update_group_decide import decide_update_group_policies

NAMES = ["run1-trainer", "run1-update-group"]


def training_run(mode="broadcast", **spec):
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
            "metadata": {"name": "run1", "namespace": "team", "uid": "run-uid"},
            "spec": {"modelPath": "/m", "weightSync": {"mode": mode}, **spec}}


def observed(policies: list[dict]) -> list[dict]:
    """As the operator's index holds them: identity (with the server's UID) and spec."""
    return [{"metadata": {"name": p["metadata"]["name"], "namespace": "team", "uid": f"uid-{i}",
                          "ownerReferences": p["metadata"]["ownerReferences"]},
             "spec": copy.deepcopy(p["spec"])} for i, p in enumerate(policies)]


def verbs(actions) -> list[tuple[str, str]]:
    return [(a.verb, a.obj["metadata"]["name"]) for a in actions]


def test_a_broadcast_run_without_its_policies_gets_both_created_as_built():
    run = training_run()
    actions = decide_update_group_policies(run, [], enabled=True)
    assert verbs(actions) == [("create", n) for n in NAMES]
    assert [a.obj for a in actions] == b.build_trainer_network_policies(run)
    assert "admits only the engines of run1-rollout" in actions[0].why


def test_policies_that_match_are_left_alone():
    run = training_run()
    assert decide_update_group_policies(run, observed(b.build_trainer_network_policies(run)),
                                        enabled=True) == []


def test_an_edited_policy_is_patched_back_and_a_deleted_one_created_again():
    run = training_run()
    trainer, group = observed(b.build_trainer_network_policies(run))
    trainer["spec"]["ingress"] = [{}]  # opened to everyone
    trainer["spec"]["egress"] = []  # and a key the builder never writes
    actions = decide_update_group_policies(run, [trainer], enabled=True)
    assert verbs(actions) == [("patch", "run1-trainer"), ("create", "run1-update-group")]
    patch = actions[0]
    assert patch.obj == b.build_trainer_network_policies(run)[0]
    assert patch.current is trainer  # the patch removes what the builder does not write (egress)
    assert "had been changed; restored" in patch.why


def test_switched_off_every_policy_of_the_run_is_deleted_even_with_a_spec_that_does_not_validate():
    run = training_run()
    current = observed(b.build_trainer_network_policies(run))
    actions = decide_update_group_policies(run, current, enabled=False)
    assert verbs(actions) == [("delete", n) for n in NAMES]
    assert [a.obj["metadata"]["uid"] for a in actions] == ["uid-0", "uid-1"]  # the observed ones, by UID
    assert all("switched off" in a.why for a in actions)
    broken = training_run(trainer={"steps": -1})
    assert verbs(decide_update_group_policies(broken, current, enabled=False)) == [("delete", n) for n in NAMES]


def test_a_run_that_left_broadcast_mode_loses_its_policies():
    current = observed(b.build_trainer_network_policies(training_run()))
    actions = decide_update_group_policies(training_run("disk"), current, enabled=True)
    assert verbs(actions) == [("delete", n) for n in NAMES]
    assert all("weightSync.mode: disk" in a.why for a in actions)
    assert decide_update_group_policies(training_run("disk"), [], enabled=True) == []
    assert decide_update_group_policies(training_run(), [], enabled=False) == []


def test_a_policy_being_deleted_is_neither_patched_nor_deleted_again():
    run = training_run()
    current = observed(b.build_trainer_network_policies(run))
    for p in current:
        p["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
        p["spec"]["ingress"] = [{}]
    assert decide_update_group_policies(run, current, enabled=True) == []
    assert decide_update_group_policies(training_run("disk"), current, enabled=True) == []


def test_a_run_whose_spec_does_not_validate_keeps_its_policies_as_they_are():
    current = observed(b.build_trainer_network_policies(training_run()))
    current[0]["spec"]["ingress"] = [{}]
    assert decide_update_group_policies(training_run(trainer={"steps": -1}), current, enabled=True) == []
