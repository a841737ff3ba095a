"""Fixtures of the cluster tests."""
from __future__ import annotations

import pytest

from helpers.cluster import clear_rlfleet_objects


@pytest.fixture(scope="module", autouse=True)
def no_rlfleet_object_outlives_its_module(control_plane):
    """Each module leaves the shared cluster without runs, fleets or their pods (see clear_rlfleet_objects)."""
    yield
    clear_rlfleet_objects(control_plane)
