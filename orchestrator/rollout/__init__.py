"""The rollout path: the classified-retry client and the producer that feeds the trainer."""
