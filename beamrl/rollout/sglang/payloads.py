"""Translation between beamrl's rollout/sync types and SGLang 0.5.23's request/response payloads.

Pure functions shared by the in-process and HTTP adapters: sampling params, generate outputs (ids, logprobs,
routed experts, finish reason, weight version) and `flattened_bucket` weight payloads.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from beamrl.protocols.rollout import EngineError, GenerateRequest, GenerateResult, SamplingParams


def sampling_dict(params: SamplingParams) -> dict[str, Any]:
    """SGLang `sampling_params` for one request; `seed` becomes SGLang's per-request `sampling_seed`."""
    d: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
        "top_k": params.top_k, "ignore_eos": params.ignore_eos,
        # Keep the stop token in output_ids so ids, logprobs and routes stay aligned.
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        d["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        d["sampling_seed"] = int(params.seed)
    return d


def generate_payload(requests: list[GenerateRequest], logprob_start_len: int = -1) -> dict[str, Any]:
    """Batch generate body (`/generate` JSON or `GenerateReqInput` kwargs) from token ids."""
    if not requests:
        raise ValueError("generate needs at least one request")
    for i, r in enumerate(requests):
        if not r.prompt_ids:
            raise ValueError(f"request {i} ({r.request_id!r}) has an empty prompt_ids")
    routed = [r.return_routed_experts for r in requests]
    if any(routed) and not all(routed):
        # SGLang takes return_routed_experts per batch, not per request.
        raise ValueError("return_routed_experts must be the same for every request of one generate call")
    payload: dict[str, Any] = {
        "input_ids": [list(map(int, r.prompt_ids)) for r in requests],
        "sampling_params": [sampling_dict(r.sampling) for r in requests],
        "return_logprob": True,
        "logprob_start_len": logprob_start_len,
        "return_routed_experts": bool(routed[0]),
    }
    rids = [r.request_id for r in requests]
    if all(rid is not None for rid in rids):
        payload["rid"] = rids
    return payload


def decode_routed_experts(encoded: str, num_layers: int, top_k: int, mlp_layer_types: list[str]) -> np.ndarray:
    """SGLang's base64 little-endian int32 routes -> int32 [rows, num_layers, top_k], dense layers set to -1.

    SGLang returns all-zero rows for dense layers, which would read as expert 0 (sglang-integration.md §5)."""
    raw = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    per_row = num_layers * top_k
    if raw.size % per_row:
        raise EngineError(f"routed_experts holds {raw.size} int32 values, not a multiple of "
                          f"num_layers*top_k = {num_layers}*{top_k}")
    if len(mlp_layer_types) != num_layers:
        raise ValueError(f"mlp_layer_types has {len(mlp_layer_types)} entries for {num_layers} layers")
    routes = raw.astype(np.int32).reshape(-1, num_layers, top_k).copy()
    dense = np.array([t != "sparse" for t in mlp_layer_types])
    routes[:, dense, :] = -1
    return routes


def _finish_reason(meta: dict[str, Any]) -> str:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind in ("stop", "length", "abort"):
        return kind
    raise EngineError(f"engine returned an unknown finish_reason {fr!r}")


def parse_weight_version(value: Any) -> int:
    """SGLang keeps versions as strings; beamrl's are integers ('default' = the launch weights = 0)."""
    if value in (None, "default"):
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineError(f"engine reports a non-integer weight version {value!r}") from None


def parse_generate_output(out: dict[str, Any], request: GenerateRequest, num_layers: int, top_k: int,
                          mlp_layer_types: list[str]) -> GenerateResult:
    """One SGLang generate output dict -> `GenerateResult`, with routes/logprob alignment checked."""
    meta = out.get("meta_info") or {}
    finish = _finish_reason(meta)
    output_ids = [int(t) for t in out.get("output_ids") or []]
    logprobs = [float(lp) for lp, _tok, *_ in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(output_ids):
        raise EngineError(f"request {meta.get('id')}: {len(output_ids)} output ids but {len(logprobs)} logprobs")
    routes = None
    if request.return_routed_experts:
        encoded = meta.get("routed_experts")
        if encoded is None:
            if finish == "abort":
                routes = np.full((0, num_layers, top_k), -1, dtype=np.int32)
            else:
                raise EngineError("routed experts were requested but the engine returned none: was it launched "
                                  "with enable_return_routed_experts=True?")
        else:
            routes = decode_routed_experts(encoded, num_layers, top_k, mlp_layer_types)
            want = len(request.prompt_ids) + len(output_ids) - 1
            if finish != "abort" and routes.shape[0] != want:
                raise EngineError(f"request {meta.get('id')}: {routes.shape[0]} route rows, expected "
                                  f"prompt_len + output_len - 1 = {want}")
    return GenerateResult(prompt_ids=list(request.prompt_ids), output_ids=output_ids, output_logprobs=logprobs,
                          finish_reason=finish, weight_version=parse_weight_version(meta.get("weight_version")),
                          routed_experts=routes, request_id=request.request_id or meta.get("id"))


def parse_prompt_logprobs(out: dict[str, Any], seq_len: int) -> list[float]:
    """`input_token_logprobs` of a logprob_start_len=0 request -> logprob of token i given < i, i = 1..T-1."""
    entries = (out.get("meta_info") or {}).get("input_token_logprobs") or []
    if len(entries) != seq_len:
        raise EngineError(f"engine returned {len(entries)} prompt logprobs for a {seq_len}-token sequence")
    if entries[0][0] is not None:
        raise EngineError("the first prompt logprob should be None (nothing predicts token 0)")
    return [float(e[0]) for e in entries[1:]]


def flattened_bucket_payloads(bucket, tp_size: int, as_str: bool, buffers: list | None = None) -> list[Any]:
    """`beamrl.protocols.flat_bucket.FlatBucket` -> SGLang `load_format="flattened_bucket"` payloads, one per TP rank.

    Each payload is `MultiprocessingSerializer.serialize({"flattened_tensor", "metadata"})` with SGLang's own
    `FlattenedTensorMetadata`, so the engine rebuilds exactly our layout (FlatBucket is byte-compatible with
    `FlattenedTensorBucket`). `as_str`: base64 strings for the HTTP JSON body, raw bytes in-process.
    `buffers`: one packed copy of the bucket per TP rank (entry r on engine rank r's device, packed by the trainer
    rank sharing it: `beamrl.sync.rank_payload`); None: the bucket's own (`FlatBucket.rank_payloads`: a
    `RankedFlatBucket`'s entries, else `bucket.buffer` for every rank)."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    import torch

    if buffers is None:
        buffers = bucket.rank_payloads(tp_size)
    if len(buffers) != tp_size:
        raise ValueError(f"bucket {bucket.index}: {len(buffers)} per-rank buffers for an engine of TP {tp_size}")
    for r, b in enumerate(buffers):
        if not isinstance(b, torch.Tensor):
            continue  # a trainer rank's CUDA-IPC handle, passed through unopened (RankedFlatBucket.payload_tensors)
        if b.dtype != torch.uint8 or b.numel() != bucket.nbytes:
            raise ValueError(f"bucket {bucket.index}: the buffer of TP rank {r} has {b.numel()} {b.dtype} elements, "
                             f"the bucket {bucket.nbytes} uint8")
    metadata = [FlattenedTensorMetadata(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype, start_idx=m.start,
                                        end_idx=m.end, numel=m.nbytes) for m in bucket.metas]
    return [MultiprocessingSerializer.serialize({"flattened_tensor": b, "metadata": metadata}, output_str=as_str)
            for b in buffers]


def check_success(result: Any, what: str, error_cls: type[Exception]) -> None:
    """SGLang returns `(success, message)` tuples or objects with `.success`/`.message`; raise with its words."""
    if result is None:
        return
    if isinstance(result, (tuple, list)) and len(result) >= 2 and isinstance(result[0], bool):
        ok, msg = result[0], result[1]
    elif isinstance(result, dict) and "success" in result:
        ok, msg = result["success"], result.get("message", "")
    elif hasattr(result, "success"):
        ok, msg = result.success, getattr(result, "message", "")
    else:
        return
    if not ok:
        raise error_cls(f"{what} failed: {msg}")
