"""Evaluation on pinned snapshots: policy, dispatcher, postures, and the public plugin API (`api`)."""
