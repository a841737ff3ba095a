"""The top of the orchestrator: the training loop, its two platforms (local, Kubernetes) and the CLI."""
