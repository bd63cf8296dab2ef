"""Compatibility layers for running third-party engines where they do not natively run (CPU-only CI)."""
