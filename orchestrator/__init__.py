"""The asyncio orchestrator: engine health, recovery, router membership, weight sync, watchdog, eval."""
