"""Weight transports by name: `TRANSPORTS.get("distributed")(receivers, ...)`.

- `colocated`: flattened buckets handed to engines on the same node (CUDA-IPC on GPU, inside the adapter).
- `distributed`: one uint8 broadcast per bucket over an NCCL/gloo update group (disaggregated engines).
- `disk`: a safetensors HF checkpoint directory, then `update_weights_from_disk`.
"""

from beamrl.registry import Registry
from beamrl.sync.protocol import WeightTransport

TRANSPORTS: Registry[type[WeightTransport]] = Registry("weight transport")

# Registration happens on import of each module.
from beamrl.sync.transports import colocated, disk, distributed  # noqa: E402,F401

__all__ = ["TRANSPORTS"]
