"""Trainer backends (torch, megatron), HF export, RL loss and the tiny offline model."""
