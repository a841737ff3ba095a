"""The optimizer state between FSDP's form (keyed by parameter name) and torch's (keyed by index)."""
from __future__ import annotations

import pytest
import torch

from rlfleet.trainer.fsdp import optimizer_state_by_index, optimizer_state_by_name, parameter_names


def test_a_single_ranks_optimizer_state_round_trips_through_names():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    by_index = optimizer.state_dict()
    names = parameter_names(model)
    by_name = optimizer_state_by_name(by_index, names)
    assert list(by_name["state"]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert by_name["param_groups"][0]["params"] == names
    again = optimizer_state_by_index(by_name, names)
    assert again["param_groups"] == by_index["param_groups"]
    assert set(again["state"]) == set(by_index["state"])
    for i, state in by_index["state"].items():
        assert all(torch.equal(state[k], again["state"][i][k]) for k in state)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(again)  # torch takes it as its own
    assert torch.equal(fresh.state_dict()["state"][2]["exp_avg"], by_index["state"][2]["exp_avg"])


def test_state_for_parameters_the_model_lacks_is_refused():
    with pytest.raises(ValueError, match=r"parameters the model does not have: \['head.weight'\]"):
        optimizer_state_by_index({"state": {"head.weight": {}}, "param_groups": []}, ["body.weight"])
    with pytest.raises(ValueError, match=r"indices \[3\] of a model of 2 parameters"):
        optimizer_state_by_name({"state": {3: {}}, "param_groups": []}, ["a", "b"])
