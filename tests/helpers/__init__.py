"""Test helpers (not shipped): real engines, routers and clusters for the test suite."""
