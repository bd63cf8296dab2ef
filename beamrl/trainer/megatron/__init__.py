"""Megatron-core training backend for Beam (docs/trainer.md)."""
