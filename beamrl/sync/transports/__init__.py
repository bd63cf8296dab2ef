"""Weight transports by name: `TRANSPORTS.get("distributed")(receivers, ...)`.

- `colocated`: engines on the trainer's node read buckets from shared staging buffers (CUDA-IPC on GPU), or take
  them as SGLang `flattened_bucket` payloads.
- `distributed`: one uint8 broadcast per bucket over an NCCL/gloo update group (disaggregated engines).
- `disk`: a safetensors HF checkpoint directory, then `update_weights_from_disk`.
"""

from beamrl.registry import Registry
from beamrl.sync.transports.base import WeightTransport

TRANSPORTS: Registry[type[WeightTransport]] = Registry("weight transport")

# Registration happens on import of each module.
from beamrl.sync.transports import colocated, disk, distributed  # noqa: E402,F401

__all__ = ["TRANSPORTS", "WeightTransport"]
