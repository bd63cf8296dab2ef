"""FlatBucket must lay tensors out byte for byte as SGLang's FlattenedTensorBucket does (the engine rebuilds the
layout of a broadcast buffer itself)."""

import pytest
import sglang.srt.weight_sync.tensor_bucket as sglang_bucket  # a required dependency: never a skip
import torch

from beamrl.protocols.flat_bucket import FlatBucket, aligned_order, layout


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.layers.0.mlp.gate.weight", torch.randn(8, 16, generator=g)),  # fp32 router
        ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(8, generator=g)),
        ("scalar", torch.tensor(3.5)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(12, 16, generator=g).to(torch.bfloat16)),
        ("odd_bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: only wider dtypes before it
        ("empty", torch.empty(0, 4, dtype=torch.bfloat16)),
        ("model.norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
    ]


def test_layout_and_bytes_equal_sglang_flattened_bucket():
    named = mixed_tensors()
    ours = FlatBucket.from_named_tensors(named)
    theirs = sglang_bucket.FlattenedTensorBucket(named_tensors=named)
    assert torch.equal(ours.buffer, theirs.get_flattened_tensor())
    got = [(m.name, tuple(m.shape), m.dtype, m.start, m.end) for m in ours.metas]
    want = [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx) for m in theirs.get_metadata()]
    assert got == want


def test_empty_layout_equals_sglang_empty_and_roundtrips_a_broadcast_buffer():
    named = mixed_tensors()
    sent = FlatBucket.from_named_tensors(named)
    ours = FlatBucket.empty(sent.names, sent.dtypes, sent.shapes, "cpu")
    theirs = sglang_bucket.FlattenedTensorBucket.empty(sent.names, sent.dtypes, sent.shapes, "cpu")
    assert [(m.start, m.end, m.dtype) for m in ours.metas] == \
        [(m.start_idx, m.end_idx, m.dtype) for m in theirs.get_metadata()]
    # What a broadcast does: copy the sender's bytes into both receive buffers, then rebuild.
    ours.buffer.copy_(sent.buffer)
    theirs.get_flattened_tensor().copy_(sent.buffer)
    for (n1, a), (n2, b), (n3, src) in zip(ours.unflatten(), theirs.reconstruct_tensors(), named):
        assert n1 == n2 == n3
        assert a.dtype == b.dtype == src.dtype and a.shape == b.shape == src.shape
        assert torch.equal(a, src) and torch.equal(b, src)


def test_accessors_use_sglang_dtype_strings():
    fb = FlatBucket.from_named_tensors(mixed_tensors())
    assert fb.dtypes[0] == "float32" and fb.dtypes[3] == "bfloat16"
    assert fb.shapes[0] == [8, 16] and fb.shapes[2] == []
    assert fb.nbytes == sum(t.numel() * t.element_size() for _, t in mixed_tensors())


def test_unflatten_returns_views():
    fb = FlatBucket.from_named_tensors([("a", torch.zeros(4)), ("b", torch.zeros(2, dtype=torch.bfloat16))])
    fb.unflatten()[1][1].fill_(1.0)
    assert torch.equal(fb.unflatten()[1][1], torch.ones(2, dtype=torch.bfloat16))


def test_unaligned_order_is_refused_like_sglang_and_aligned_order_fixes_it():
    named = [("odd", torch.zeros(3, dtype=torch.bfloat16)), ("router", torch.zeros(2))]
    with pytest.raises(ValueError, match="'router'.*byte 6"):
        FlatBucket.from_named_tensors(named)
    with pytest.raises(ValueError, match="Unaligned"):
        sglang_bucket.FlattenedTensorBucket.empty(["odd", "router"], ["bfloat16", "float32"], [[3], [2]], "cpu")
    fb = FlatBucket.from_named_tensors(aligned_order(named))
    assert fb.names == ["router", "odd"]


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="zero tensors"):
        FlatBucket.from_named_tensors([])
    with pytest.raises(ValueError, match="unknown dtype 'bfloat17'"):
        layout(["x"], ["bfloat17"], [[1]])
    with pytest.raises(ValueError, match="'x' has a negative dimension"):
        layout(["x"], ["float32"], [[-1]])
