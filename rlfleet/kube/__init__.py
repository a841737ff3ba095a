"""The Kubernetes layer: a small asyncio API client, condition helpers and pod status reading."""
