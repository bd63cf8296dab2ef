"""Parity tools: compare engines and the reference Beam model token by token (docs/parity.md)."""
