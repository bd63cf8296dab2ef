"""Fused GPU kernels for the Beam trainer, matched to the engine's rounding (docs/kernels.md).

`beamrl.kernels.ops` is the public entry point: every op takes an explicit `backend` ("eager" composes
`beamrl.models.beam.numerics`; "triton" runs the fused kernels / FlexAttention / grouped GEMMs).
"""
