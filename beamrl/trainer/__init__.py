"""Trainers for Beam (docs/trainer.md)."""
