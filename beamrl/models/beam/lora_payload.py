"""The adapter payload: what an adapter-only weight sync sends, and its checks (docs/lora.md "Adapter sync").

A payload is a list of named tensors, so it travels through every weight-sync transport unchanged:

1. `beamrl.lora.manifest` (uint8): UTF-8 JSON + a newline + the SHA-256 hex of the JSON bytes. The JSON holds
   the format tag, the adapter id, the `LoRAConfig` (recipe form), the FP32 scale (`float.hex`), and for every
   adapter tensor its shape, dtype and SHA-256 of its raw bytes;
2. every adapter tensor, full (TP/EP-gathered), named as in `beamrl.models.beam.lora` (`...lora_A.weight` /
   `...lora_B.weight`), in any order and any number of buckets; the manifest travels in the first bucket
   (anywhere in it: a receiver takes it first).

Receivers (`lora_receiver.AdapterReceiver`) check the manifest's own checksum, that its tensor set is exactly the
adapter table of their model and LoRA config, and each tensor's shape, dtype and SHA-256 on arrival.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from beamrl.models.beam.lora_config import LoRAConfig

MANIFEST_NAME = "beamrl.lora.manifest"
FORMAT = "beamrl-lora/1"
_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class AdapterPayloadError(ValueError):
    """An adapter payload is malformed or fails a check; the message names the tensor and the check."""


def is_adapter_tensor_name(name: str) -> bool:
    """True for the manifest and for adapter tensor names (the receivers route these away from base loading)."""
    return name == MANIFEST_NAME or name.endswith(_ADAPTER_SUFFIXES)


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 hex of a tensor's raw bytes (row-major, its own dtype; copied to host memory for hashing)."""
    flat = t.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class AdapterManifest:
    """The decoded manifest. `tensors`: name -> (shape, dtype name, sha256 hex)."""

    adapter_id: str
    lora: LoRAConfig
    scale: float
    tensors: dict[str, tuple[tuple[int, ...], str, str]]
    digest: str  # SHA-256 of the manifest JSON: identifies this exact adapter

    def check_tensor(self, name: str, t: torch.Tensor) -> None:
        """Raise `AdapterPayloadError` unless `t` is exactly the tensor the manifest announced under `name`."""
        if name not in self.tensors:
            raise AdapterPayloadError(f"adapter tensor {name!r} is not in the manifest of adapter {self.adapter_id!r}")
        shape, dtype, sha = self.tensors[name]
        if tuple(t.shape) != tuple(shape) or _dtype_name(t.dtype) != dtype:
            raise AdapterPayloadError(f"adapter tensor {name!r} arrived as {_dtype_name(t.dtype)} {tuple(t.shape)}, "
                                      f"the manifest says {dtype} {tuple(shape)}")
        got = tensor_sha256(t)
        if got != sha:
            raise AdapterPayloadError(f"adapter tensor {name!r} failed its SHA-256 check (expected {sha[:16]}..., "
                                      f"got {got[:16]}...): corrupted in transit; adapter {self.adapter_id!r} refused")


def build_adapter_payload(tensors: dict[str, torch.Tensor], lora: LoRAConfig,
                          adapter_id: str) -> list[tuple[str, torch.Tensor]]:
    """[manifest, *tensors]: the payload of one adapter (checksums computed here, on the sender)."""
    body = {"format": FORMAT, "adapter_id": str(adapter_id), "lora": lora.to_dict(), "scale": float.hex(lora.scale),
            "tensors": {n: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "sha256": tensor_sha256(t)}
                        for n, t in tensors.items()}}
    raw = json.dumps(body, sort_keys=True).encode()
    blob = raw + b"\n" + hashlib.sha256(raw).hexdigest().encode()
    manifest = torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()
    return [(MANIFEST_NAME, manifest)] + list(tensors.items())


def decode_manifest(t: torch.Tensor) -> AdapterManifest:
    """Parse and verify a manifest tensor (its own SHA-256 first)."""
    blob = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    raw, sep, digest = blob.rpartition(b"\n")
    if not sep or hashlib.sha256(raw).hexdigest().encode() != digest:
        raise AdapterPayloadError(f"{MANIFEST_NAME} failed its SHA-256 check: corrupted in transit; adapter refused")
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise AdapterPayloadError(f"{MANIFEST_NAME} is not valid JSON: {e}") from None
    if body.get("format") != FORMAT:
        raise AdapterPayloadError(f"{MANIFEST_NAME} has format {body.get('format')!r}, expected {FORMAT!r}")
    lora = LoRAConfig.from_dict(body["lora"])
    scale = float.fromhex(body["scale"])
    if scale != lora.scale:
        raise AdapterPayloadError(f"{MANIFEST_NAME}: scale {scale!r} does not match alpha/rank of its LoRAConfig "
                                  f"({lora.scale!r})")
    tensors = {n: (tuple(v["shape"]), v["dtype"], v["sha256"]) for n, v in body["tensors"].items()}
    return AdapterManifest(body["adapter_id"], lora, scale, tensors, digest.decode())
