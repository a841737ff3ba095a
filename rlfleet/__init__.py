"""rlfleet: fault-tolerant SGLang rollout fleets for RL post-training on Kubernetes."""

__version__ = "0.1.0"
