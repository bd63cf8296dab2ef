"""Beam: config, weight table, numerics and the pure-PyTorch reference model."""

from beamrl.models.beam.config import BeamConfig, BeamConfigError
from beamrl.models.beam.kv_cache import KVCache
from beamrl.models.beam.model import BeamForCausalLM, BeamOutput
from beamrl.models.beam.presets import PRESETS, preset

__all__ = ["BeamConfig", "BeamConfigError", "BeamForCausalLM", "BeamOutput", "KVCache", "PRESETS", "preset"]
