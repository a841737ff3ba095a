"""The rollout requests' sampling parameters come from spec.trainer, every field of it."""
from __future__ import annotations

from rlfleet.crds.models import TrainerSpec
from rlfleet.orchestrator.rollout.producer import SamplingSettings


def test_rollout_requests_sample_with_the_trainers_settings():
    trainer = TrainerSpec.model_validate({"maxNewTokens": 24, "temperature": 0.7, "topP": 0.9})
    assert SamplingSettings.for_trainer(trainer, eos_token_id=2).request_params() == {
        "max_new_tokens": 24, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": [2]}


def test_without_an_eos_token_nothing_stops_early_and_top_p_defaults_to_one():
    params = SamplingSettings.for_trainer(TrainerSpec(), eos_token_id=None).request_params()
    assert params["top_p"] == 1.0 and "stop_token_ids" not in params
