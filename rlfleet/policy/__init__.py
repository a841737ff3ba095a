"""Pure policies that the operator and the orchestrator share (restart budgets and backoff)."""
