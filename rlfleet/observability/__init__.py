"""Prometheus metrics (every name defined once), PromQL tooling and the dashboard/alert checks."""
