"""The LoRA status of beamrl's out-of-tree SGLang Beam class, as both SGLang adapters (in-process and HTTP) read
and check it (docs/lora.md "SGLang"). The class answers `get_weights_by_name(STATUS_NAME)` with a JSON object as
the float list of its UTF-8 bytes (the only reply type SGLang's API carries)."""

from __future__ import annotations

import json

from beamrl.protocols.weights import WeightSyncError
from beamrl.rollout.sglang.models import STATUS_NAME

__all__ = ["STATUS_NAME", "decode_status", "check_adapter_applied"]


def decode_status(out, engine: str) -> dict:
    """{"lora_class", "targets", "applied", "staged", "error"} from a `get_weights_by_name` reply."""
    if not out:
        raise WeightSyncError(f"{engine}: no LoRA status: the engine is not serving beamrl's Beam class")
    return json.loads(bytes(int(x) for x in out).decode())


def check_adapter_applied(status: dict, applied_before: int, engine: str) -> None:
    """After an adapter session's last bucket: exactly one more adapter merged and no refusal recorded (the class
    cannot raise out of SGLang's loader)."""
    if status["error"] or status["applied"] != applied_before + 1 or status["staged"]:
        why = status["error"] or f"incomplete adapter ({status['staged']} tensors staged)"
        raise WeightSyncError(f"{engine}: the LoRA adapter was not applied: {why}")
