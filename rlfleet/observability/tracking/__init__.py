"""Trackers of the run's per-step record (spec.tracking): TensorBoard event files, an MLflow server.

A tracker is `async open(params)`, `async log(step, scalars)`, `async close(status)`; `TrackerSink`
runs one beside the training loop: `submit()` never waits, a failing or slow tracker warns once,
counts what it drops (rlfleet_tracker_records_total) and the run goes on. File I/O runs in threads.
"""
