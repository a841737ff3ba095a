"""Where evaluation runs: on the rollout fleet (shared), its own fleet, or an external evaluator."""
