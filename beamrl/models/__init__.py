"""Model definitions owned by beamrl (the Beam reference model and its checkpoint format)."""
