"""Beam: config, weight table, numerics and the pure-PyTorch reference model."""

from beamrl.models.beam.config import BeamConfig, BeamConfigError
from beamrl.models.beam.presets import PRESETS, preset

__all__ = ["BeamConfig", "BeamConfigError", "PRESETS", "preset"]
