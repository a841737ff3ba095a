"""Guards that stop a run going bad: the 503 watchdog and the heat guard."""
