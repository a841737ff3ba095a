"""The Kopf operator (imported only as rlfleet.operator; never as the stdlib's `operator`)."""
