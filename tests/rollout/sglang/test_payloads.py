"""Pure payload translation: routes decoding/masking, generate outputs, sampling params, flattened buckets."""

import base64

import numpy as np
import pytest
import torch

from beamrl.models.beam import preset
from beamrl.protocols.rollout import EngineError, GenerateRequest, SamplingParams
from beamrl.rollout.sglang import payloads


def _encode(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode()


def test_decode_routes_reshapes_and_masks_dense_layers():
    c = preset("tiny")
    L, k = c.num_hidden_layers, c.num_experts_per_tok
    rng = np.random.default_rng(0)
    raw = rng.integers(0, c.num_experts, (7, L, k)).astype(np.int32)
    raw[:, [i for i in range(L) if not c.is_moe(i)]] = 0  # SGLang's all-zero dense rows
    out = payloads.decode_routed_experts(_encode(raw), L, k, c.mlp_layer_types)
    assert out.shape == (7, L, k) and out.dtype == np.int32
    for layer in range(L):
        if c.is_moe(layer):
            np.testing.assert_array_equal(out[:, layer], raw[:, layer])
        else:
            assert (out[:, layer] == -1).all()


def test_decode_routes_rejects_bad_length():
    with pytest.raises(EngineError, match="multiple"):
        payloads.decode_routed_experts(_encode(np.zeros(5)), 6, 4, ["dense"] + ["sparse"] * 5)


def _output(prompt_len, out_ids, routes, finish="length", version="3"):
    meta = {"id": "r1", "finish_reason": {"type": finish}, "weight_version": version,
            "output_token_logprobs": [(-0.5 - i, t, None) for i, t in enumerate(out_ids)]}
    if routes is not None:
        meta["routed_experts"] = _encode(routes)
    return {"output_ids": out_ids, "meta_info": meta}


def test_parse_generate_output_aligns_ids_logprobs_routes():
    c = preset("tiny")
    L, k = c.num_hidden_layers, c.num_experts_per_tok
    req = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2), return_routed_experts=True)
    routes = np.ones((3 + 2 - 1, L, k), np.int32)
    res = payloads.parse_generate_output(_output(3, [9, 8], routes), req, L, k, c.mlp_layer_types)
    assert res.output_ids == [9, 8] and res.output_logprobs == [-0.5, -1.5]
    assert res.finish_reason == "length" and res.weight_version == 3
    assert res.routed_experts.shape == (4, L, k) and (res.routed_experts[:, 0] == -1).all()
    bad = np.ones((3, L, k), np.int32)  # one row short
    with pytest.raises(EngineError, match="route rows"):
        payloads.parse_generate_output(_output(3, [9, 8], bad), req, L, k, c.mlp_layer_types)
    with pytest.raises(EngineError, match="enable_return_routed_experts"):
        payloads.parse_generate_output(_output(3, [9, 8], None), req, L, k, c.mlp_layer_types)


def test_weight_version_parsing():
    assert payloads.parse_weight_version("default") == 0
    assert payloads.parse_weight_version("12") == 12
    with pytest.raises(EngineError):
        payloads.parse_weight_version("v1")


def test_sampling_dict_maps_seed_and_keeps_stop_tokens():
    d = payloads.sampling_dict(SamplingParams(max_new_tokens=5, temperature=0.7, seed=9, stop_token_ids=(4,)))
    assert d["sampling_seed"] == 9 and d["stop_token_ids"] == [4] and d["no_stop_trim"] is True
    assert "sampling_seed" not in payloads.sampling_dict(SamplingParams())


def test_generate_payload_validation():
    with pytest.raises(ValueError, match="empty prompt_ids"):
        payloads.generate_payload([GenerateRequest([])])
    with pytest.raises(ValueError, match="same for every request"):
        payloads.generate_payload([GenerateRequest([1], return_routed_experts=True), GenerateRequest([2])])


def test_check_success_raises_with_engine_message():
    payloads.check_success((True, "ok"), "x", RuntimeError)
    with pytest.raises(RuntimeError, match="x failed: boom"):
        payloads.check_success((False, "boom"), "x", RuntimeError)
    with pytest.raises(RuntimeError, match="nope"):
        payloads.check_success({"success": False, "message": "nope"}, "x", RuntimeError)


def test_flattened_bucket_payload_round_trips_through_sglang_deserializer():
    from beamrl.compat.sglang_cpu import activate

    activate()
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from beamrl.protocols.flat_bucket import FlatBucket

    named = [("a.weight", torch.randn(3, 4)), ("b.weight", torch.randn(5).bfloat16())]
    bucket = FlatBucket.from_named_tensors(named)
    out = payloads.flattened_bucket_payloads(bucket, tp_size=2, as_str=True)
    assert len(out) == 2 and all(isinstance(p, str) for p in out)
    data = MultiprocessingSerializer.deserialize(out[1])
    rebuilt = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    for (n, t), (n2, t2) in zip(named, rebuilt.reconstruct_tensors()):
        assert n == n2 and t2.dtype == t.dtype and torch.equal(t, t2)
