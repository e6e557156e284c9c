"""Parallelisms applied to a plain model from outside: pipeline, tensor, FSDP2 checkpointing, activations."""
