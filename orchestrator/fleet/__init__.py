"""A fleet of engines: backends (local, Kubernetes), health, recovery, router membership, weight sync."""
