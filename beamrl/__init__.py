"""beamrl: distributed RL post-training for the Beam MoE."""

__version__ = "0.1.0"
