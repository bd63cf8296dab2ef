"""Each numeric rule of beam-numerics.md §3, pinned against an independent float64 / step-by-step computation."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from beamrl.models.beam import numerics

BF16 = torch.bfloat16


def test_ssmax_matches_float64_formula_and_power_form_differs():
    positions = torch.tensor([0, 1, 2, 100, 2047, 2048, 65535, 1_048_575])
    got = numerics.ssmax_scale(positions)
    assert got.dtype == torch.float32
    for p, s in zip(positions.tolist(), got.tolist()):
        exact = math.exp(0.1 * math.log1p((p + 1) / 2048))
        assert s == pytest.approx(exact, rel=2e-7)  # within an FP32 ulp of the exact value
    assert got[0].item() == pytest.approx((1 + 1 / 2048) ** 0.1, rel=1e-7)
    # The exp/log1p form is the contract: the algebraically equal power form differs in the last FP32 bit.
    many = torch.arange(0, 200_000)
    power = (1 + (many.float() + 1) / 2048) ** 0.1
    assert (power != numerics.ssmax_scale(many)).any()


def test_apply_ssmax_rounds_once():
    q = torch.randn(5, 3, 16).to(BF16)
    scale = numerics.ssmax_scale(torch.arange(5) * 1000)
    manual = (q.float() * scale.view(5, 1, 1)).to(BF16)
    assert torch.equal(numerics.apply_ssmax(q, scale), manual)


def test_output_gate_three_roundings():
    torch.manual_seed(0)
    o = torch.randn(64, 4, 16).to(BF16)
    g = (3 * torch.randn(64, 4, 16)).to(BF16)
    b = torch.randn(4).to(BF16)
    got = numerics.output_gate(o, g, b)
    gb = (g.float() + b.float().view(4, 1)).to(BF16)  # rounding 1
    sg = torch.sigmoid(gb.float()).to(BF16)  # rounding 2
    manual = (o.float() * sg.float()).to(BF16)  # rounding 3
    assert torch.equal(got, manual)
    single = (o.float() * torch.sigmoid(g.float() + b.float().view(4, 1))).to(BF16)
    assert not torch.equal(got, single)  # the rounding order is observable


def test_depth_scaled_residual_roundings_and_counters(tiny_config):
    torch.manual_seed(1)
    x, h = torch.randn(32, 64).to(BF16), torch.randn(32, 64).to(BF16)
    for layer in range(tiny_config.num_hidden_layers):
        for branch, d in (("attn", 2 * (layer + 1)), ("mlp", 2 * (layer + 1) + 1)):
            sb, sr = tiny_config.residual_scales(layer, branch)
            assert sb == 1 / math.sqrt(d) and sr == math.sqrt(d - 1) / math.sqrt(d)
            got = numerics.depth_scaled_residual(x, h, (sb, sr))
            manual = ((x.float() * sb).to(BF16).float() + (h.float() * sr).to(BF16).float()).to(BF16)
            assert torch.equal(got, manual)
    # layer 0 attention: the embedding is residual term 1, so both terms are scaled by sqrt(1/2) (d = 2),
    # computed as SGLang does (1/sqrt(2), which differs from sqrt(0.5) in the last double bit)
    assert tiny_config.residual_scales(0, "attn") == (1 / math.sqrt(2), 1 / math.sqrt(2))
    assert tiny_config.residual_scales(0, "attn")[0] == pytest.approx(math.sqrt(0.5), rel=1e-15)


def test_rms_norm_single_rounding_weight_as_stored():
    x = torch.randn(8, 64).to(BF16)
    w = (1 + 0.1 * torch.randn(64)).to(BF16)
    xd, wd = x.double(), w.double()
    exact = xd / torch.sqrt((xd ** 2).mean(-1, keepdim=True) + 1e-6) * wd
    got = numerics.rms_norm(x, w, 1e-6)
    assert torch.equal(got, numerics.rms_norm(x.float(), w, 1e-6).to(BF16))
    assert torch.allclose(numerics.rms_norm(x.float(), w.float(), 1e-6).double(), exact, rtol=1e-5, atol=1e-6)


def test_swiglu_single_rounding_differs_from_double():
    torch.manual_seed(2)
    gate, up = (3 * torch.randn(4096)).to(BF16), (3 * torch.randn(4096)).to(BF16)
    got = numerics.swiglu(gate, up)
    assert torch.equal(got, (F.silu(gate.float()) * up.float()).to(BF16))
    double = (F.silu(gate.float()).to(BF16).float() * up.float()).to(BF16)  # SGLang's CPU path
    assert not torch.equal(got, double)


def test_rope_matches_float64_complex_rotation():
    torch.manual_seed(3)
    d, theta = 16, 10000.0
    pos = torch.tensor([0, 1, 7, 511, 4095])
    x = torch.randn(5, 2, d)
    cos, sin = numerics.rope_cos_sin(pos, d, theta)
    got = numerics.apply_rope(x, cos, sin)
    j = torch.arange(d // 2, dtype=torch.float64)
    inv = 1.0 / theta ** (2 * j / d)
    xd = x.double()
    z = torch.complex(xd[..., : d // 2], xd[..., d // 2:]) * torch.exp(1j * pos.double().view(5, 1, 1) * inv)
    ref = torch.cat((z.real, z.imag), dim=-1)
    # FP32 angles at position 4095 carry ~4e-4 absolute error in the angle of the fastest frequency.
    assert torch.allclose(got.double(), ref, atol=2e-3, rtol=0)
    assert torch.allclose(got[:3].double(), ref[:3], atol=1e-5, rtol=0)
    xb = x.to(BF16)
    assert torch.equal(numerics.apply_rope(xb, cos, sin), numerics.apply_rope(xb.float(), cos, sin).to(BF16))


def _brute_force_grouped_topk(logits, bias, k, n_group, topk_group):
    """Enumerate every choice of topk_group groups; keep the one with the largest sum of top-2 group scores."""
    scores = torch.sigmoid(logits.double())
    choice = scores + bias.double()
    per = logits.shape[0] // n_group
    group_score = [sorted(choice[g * per:(g + 1) * per].tolist())[-2:] for g in range(n_group)]
    group_score = [sum(s) for s in group_score]
    best = max(itertools.combinations(range(n_group), topk_group), key=lambda gs: sum(group_score[g] for g in gs))
    allowed = [e for g in best for e in range(g * per, (g + 1) * per)]
    ids = sorted(allowed, key=lambda e: -choice[e].item())[:k]
    w = scores[ids]
    return set(ids), {e: (w[i] / w.sum()).item() for i, e in enumerate(ids)}


def test_grouped_topk_matches_brute_force():
    torch.manual_seed(4)
    E, k, n_group, topk_group = 32, 4, 8, 3
    logits = 2 * torch.randn(50, E)
    bias = 0.3 * torch.randn(E)
    weights, ids = numerics.grouped_topk(logits, bias, k, n_group, topk_group)
    assert weights.dtype == torch.float32
    for t in range(50):
        ref_ids, ref_w = _brute_force_grouped_topk(logits[t], bias, k, n_group, topk_group)
        assert set(ids[t].tolist()) == ref_ids
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            assert w == pytest.approx(ref_w[e], rel=1e-6)
    # the correction bias decides selection (a large bias forces an expert in) but never enters the weights
    bias2 = bias.clone()
    bias2[5] = 10.0
    w2, ids2 = numerics.grouped_topk(logits, bias2, k, n_group, topk_group)
    assert (ids2 == 5).any(dim=1).all()
    s = torch.sigmoid(logits)
    assert torch.allclose(w2, s.gather(1, ids2) / s.gather(1, ids2).sum(1, keepdim=True))


def test_window_mask_edges():
    window = 8
    pos = torch.arange(20)
    m = numerics.sliding_window_mask(pos, pos, window)
    assert m[10, 10 - (window - 1)] and m[10, 10]
    assert not m[10, 10 - window] and not m[10, 11]
    assert int(m[19].sum()) == window  # window keys including self
    full = numerics.sliding_window_mask(pos, pos, None)
    assert torch.equal(full, torch.ones(20, 20, dtype=torch.bool).tril())
    batched = numerics.sliding_window_mask(torch.stack([pos, pos + 3]), torch.stack([pos, pos + 3]), window)
    assert torch.equal(batched[0], m) and torch.equal(batched[1], m)


def test_softcap_values():
    x = torch.tensor([-1000.0, -30.0, -1.0, 0.0, 0.5, 30.0, 60.0, 1e6]).to(BF16)
    got = numerics.softcap(x, 30.0)
    assert got.dtype == torch.float32
    for xi, yi in zip(x.float().tolist(), got.tolist()):
        assert yi == pytest.approx(30.0 * math.tanh(xi / 30.0), rel=1e-6, abs=1e-6)
    assert got.abs().max() <= 30.0
    assert torch.equal(numerics.softcap(x, None), x.float())


def test_attention_batched_equals_unbatched():
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    mask = numerics.sliding_window_mask(torch.arange(6), torch.arange(6), 3)
    out = numerics.attention(q, k, v, mask.expand(2, 6, 6))
    for b in range(2):
        assert torch.allclose(out[b], numerics.attention(q[b], k[b], v[b], mask), atol=1e-6)
    # float64 reference of one head: GQA maps query head 3 to kv head 1
    s = (q[1, :, 3].double() @ k[1, :, 1].double().T) / math.sqrt(8)
    s = s.masked_fill(~mask, float("-inf")).softmax(-1)
    assert torch.allclose(out[1, :, 3].double(), s @ v[1, :, 1].double(), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [8, 32, 64])
def test_grouped_expert_outputs_equal_expert_output_per_expert(dtype, inter):
    """The CPU grouped-GEMM path gives every expert's `expert_output` bit for bit, forward and backward; the
    per-expert counts are odd, so with I = 8 a single SiLU over all rows would round some elements differently
    (per-expert SiLU); with I a multiple of the vector block one SiLU over all rows rounds as the loop."""
    g = torch.Generator().manual_seed(3)
    sizes = [5, 0, 13, 1, 7, 0, 9, 3, 30, 17]
    E, H, I, N = len(sizes), 16, inter, sum(sizes)
    assert numerics.silu_rounds_per_row(torch.empty(N, I)) == (I % numerics.SILU_VECTOR_BLOCK == 0)
    x = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    gate_up = torch.randn(E, 2 * I, H, generator=g).to(dtype).requires_grad_()
    down = torch.randn(E, H, I, generator=g).to(dtype).requires_grad_()
    weight = torch.rand(N, generator=g).requires_grad_()
    gy = torch.randn(N, H, generator=g).to(dtype)
    gy[::4], gy[1::4] = -0.0, 0.0  # rows with exact zeros of both signs (tokens without loss weight)
    rows, ws = x.split(sizes), weight.split(sizes)
    want = torch.cat([numerics.expert_output(rows[e], gate_up[e, :I], gate_up[e, I:], down[e], ws[e])
                      for e in range(E) if sizes[e]])
    got = numerics.grouped_expert_outputs(x, sizes, gate_up, down, weight)
    assert torch.equal(got, want)
    leaves = (x, gate_up, down, weight)
    bits = lambda t: t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)  # noqa: E731
    for a, b in zip(torch.autograd.grad(got, leaves, gy), torch.autograd.grad(want, leaves, gy)):
        assert torch.equal(bits(a), bits(b))  # signed zeros too


def _einsum_attention(q, k, v, mask):
    """`numerics.attention` as it was written with torch.einsum (the reference of the bmm form)."""
    hq, hkv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    qg = q.float().unflatten(-2, (hkv, hq // hkv))
    scores = torch.einsum("...qgrd,...kgd->...grqk", qg, k.float()) * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~mask.unsqueeze(-3).unsqueeze(-3), float("-inf"))
    out = torch.einsum("...grqk,...kgd->...qgrd", torch.softmax(scores, dim=-1), v.float())
    return out.flatten(-3, -2).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_attention_bmm_form_equals_einsum(dtype, lead):
    """The explicit bmm form of `numerics.attention` gives einsum's bits, forward and backward (GQA and MHA,
    prefill and decode-like shapes)."""
    g = torch.Generator().manual_seed(len(lead))
    for tq, tk, hkv, rep, d in [(7, 7, 2, 2, 16), (1, 9, 2, 2, 16), (5, 8, 1, 3, 8), (11, 11, 4, 1, 64)]:
        q = torch.randn(*lead, tq, hkv * rep, d, generator=g).to(dtype).requires_grad_()
        k, v = (torch.randn(*lead, tk, hkv, d, generator=g).to(dtype).requires_grad_() for _ in range(2))
        mask = torch.rand(*lead, tq, tk, generator=g) < 0.7
        mask[..., 0] = True
        gy = torch.randn(*lead, tq, hkv * rep, d, generator=g).to(dtype)
        got, want = numerics.attention(q, k, v, mask), _einsum_attention(q, k, v, mask)
        assert torch.equal(got, want)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), gy), torch.autograd.grad(want, (q, k, v), gy)):
            assert torch.equal(a, b)
