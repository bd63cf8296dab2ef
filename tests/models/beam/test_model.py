"""BeamForCausalLM: wiring vs an independent float64 implementation, routes, KV cache, packing, weight loading."""

import math

import pytest
import torch

from beamrl.models.beam import BeamForCausalLM, numerics
from beamrl.models.beam.kv_cache import KVCache
from beamrl.models.beam.weights import expected_tensors, packed_expert_names, random_state_dict


@pytest.fixture(scope="module")
def cfg():
    from beamrl.models.beam import preset

    return preset("tiny")


@pytest.fixture(scope="module")
def m32(cfg):
    return BeamForCausalLM(cfg, dtype=torch.float32, seed=7).eval()


@pytest.fixture(scope="module")
def m16(cfg):
    return BeamForCausalLM(cfg, dtype=torch.bfloat16, seed=7).eval()


def _f64_forward(cfg, sd, ids, routes):
    """Beam in float64 written straight from beam-numerics.md §3 (no roundings); MoE uses the given routes."""
    sd = {k: v.double() for k, v in sd.items()}
    T, D, Hq, Hkv = len(ids), cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rot(x, pos):  # NeoX split-half as a complex rotation
        inv = 1.0 / cfg.rope_theta ** (2 * torch.arange(D // 2, dtype=torch.float64) / D)
        z = torch.complex(x[..., : D // 2], x[..., D // 2:]) * torch.exp(1j * pos.view(-1, 1, 1) * inv)
        return torch.cat((z.real, z.imag), -1)

    pos = torch.arange(T, dtype=torch.float64)
    h = sd["model.embed_tokens.weight"][ids]
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        a = rms(h, sd[p + "input_layernorm.weight"])
        q = (a @ sd[p + "self_attn.q_proj.weight"].T).view(T, Hq, D)
        k = (a @ sd[p + "self_attn.k_proj.weight"].T).view(T, Hkv, D)
        v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(T, Hkv, D)
        g = (a @ sd[p + "self_attn.gate_proj.weight"].T).view(T, Hq, D)
        q, k = rms(q, sd[p + "self_attn.q_norm.weight"]), rms(k, sd[p + "self_attn.k_norm.weight"])
        if cfg.is_sliding(l):
            q, k = rot(q, pos), rot(k, pos)
        else:
            q = q * torch.exp(0.1 * torch.log1p((pos + 1) / 2048)).view(T, 1, 1)
        o = torch.zeros(T, Hq, D, dtype=torch.float64)
        for hh in range(Hq):
            kh = hh // (Hq // Hkv)
            s = q[:, hh] @ k[:, kh].T / math.sqrt(D)
            i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
            vis = (j <= i) & ((i - j < cfg.sliding_window) if cfg.is_sliding(l) else True)
            o[:, hh] = s.masked_fill(~vis, -math.inf).softmax(-1) @ v[:, kh]
        o = o * torch.sigmoid(g + sd[p + "self_attn.gate_bias"].view(Hq, 1))
        o = o.reshape(T, Hq * D) @ sd[p + "self_attn.o_proj.weight"].T
        d = 2 * (l + 1)
        h = rms(o, sd[p + "post_attention_layernorm.weight"]) / math.sqrt(d) + h * math.sqrt(d - 1) / math.sqrt(d)
        x = rms(h, sd[p + "pre_feedforward_layernorm.weight"])

        def mlp(pre, x):
            gt, up = x @ sd[pre + "gate_proj.weight"].T, x @ sd[pre + "up_proj.weight"].T
            return (torch.nn.functional.silu(gt) * up) @ sd[pre + "down_proj.weight"].T

        if cfg.is_moe(l):
            s = torch.sigmoid(x @ sd[p + "mlp.gate.weight"].T)
            y = torch.zeros_like(x)
            for t in range(T):
                chosen = routes[t, l].long()
                w = s[t, chosen] / s[t, chosen].sum()
                for wk, e in zip(w, chosen.tolist()):
                    y[t] += wk * mlp(f"{p}mlp.experts.{e}.", x[t])
            y = cfg.routed_scaling_factor * y
        else:
            y = mlp(p + "mlp.", x)
        d = 2 * (l + 1) + 1
        h = rms(y, sd[p + "post_feedforward_layernorm.weight"]) / math.sqrt(d) + h * math.sqrt(d - 1) / math.sqrt(d)
    logits = rms(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T
    return cfg.final_logit_softcapping * torch.tanh(logits / cfg.final_logit_softcapping)


def test_names_are_the_hf_table_and_router_stays_fp32(cfg, m16):
    assert sorted(m16.state_dict()) == sorted(expected_tensors(cfg))
    for name, spec in expected_tensors(cfg).items():
        assert m16.state_dict()[name].dtype == (torch.float32 if spec.fp32 else torch.bfloat16), name
    m = BeamForCausalLM(cfg, dtype=torch.float32, seed=1).to(torch.bfloat16)
    assert m.state_dict()["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert m.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert m.state_dict()["model.layers.1.self_attn.gate_bias"].dtype == torch.bfloat16
    assert not dict(m.named_parameters())["model.layers.1.mlp.gate.e_score_correction_bias"].requires_grad


def test_fp32_forward_matches_independent_float64_implementation(cfg, m32):
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 19))  # longer than the window (8), spans full + SWA layers
    with torch.no_grad():
        out = m32(ids, return_routes=True)
    ref = _f64_forward(cfg, m32.state_dict(), ids[0], out.routes[0])
    assert out.logits.dtype == torch.float32
    assert torch.allclose(out.logits[0].double(), ref, atol=2e-4, rtol=0), (out.logits[0].double() - ref).abs().max()
    dense = [l for l in range(cfg.num_hidden_layers) if not cfg.is_moe(l)]
    assert (out.routes[:, :, dense] == -1).all()
    assert out.routes.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_returned_routes_forced_reproduce_the_forward_exactly(cfg, m32, m16, dtype):
    m = m32 if dtype == torch.float32 else m16
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = m(ids, return_routes=True)
        forced = m(ids, forced_routes=out.routes, return_routes=True)
        assert torch.equal(out.logits, forced.logits)
        assert torch.equal(out.routes, forced.routes)
        # other routes (random distinct experts) change the output
        g = torch.Generator().manual_seed(2)
        rnd = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.num_experts_per_tok]
                           for _ in range(2 * 12 * cfg.num_hidden_layers)]).view_as(out.routes)
        other = m(ids, forced_routes=rnd, return_routes=True)
    assert not torch.allclose(out.logits, other.logits)
    moe = cfg.moe_layers
    assert torch.equal(other.routes[:, :, moe], rnd[:, :, moe].int())


def test_forced_routes_validation(cfg, m32):
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="shape"):
        m32(ids, forced_routes=torch.zeros(1, 3, 2, 2, dtype=torch.long))
    bad = torch.zeros(1, 3, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.long)
    bad[0, 1, cfg.moe_layers[0], 0] = cfg.num_experts
    with pytest.raises(ValueError, match="outside"):
        m32(ids, forced_routes=bad)
    bad[0, 1, cfg.moe_layers[0], 0] = 0
    bad[0, 1, 0, 0] = -1  # dense-layer rows are ignored
    m32(ids, forced_routes=bad)


def _ragged(cfg, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, cfg.vocab_size, (n,), generator=g) for n in lengths]


def _left_pad(seqs):
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):], mask[i, T - len(s):] = s, True
    return ids, mask


def _cached_decode(m, prompts, continuations):
    """Left-padded prefill + one token per step; returns per-row logits/routes of the real tokens."""
    ids, mask = _left_pad(prompts)
    out = m(ids, attention_mask=mask, use_cache=True, return_routes=True)
    logits = [[out.logits[i, mask[i]]] for i in range(len(prompts))]
    routes = [[out.routes[i, mask[i]]] for i in range(len(prompts))]
    for step in range(continuations.shape[1]):
        o = m(continuations[:, step: step + 1], kv_cache=out.kv_cache, return_routes=True)
        for i in range(len(prompts)):
            logits[i].append(o.logits[i])
            routes[i].append(o.routes[i])
    return [torch.cat(x) for x in logits], [torch.cat(x) for x in routes]


def test_kv_cached_ragged_decoding_equals_full_forward_fp32(cfg, m32):
    prompts = _ragged(cfg, [5, 11, 3], seed=3)
    cont = torch.randint(1, cfg.vocab_size, (3, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, routes = _cached_decode(m32, prompts, cont)
        for i, p in enumerate(prompts):
            full = m32(torch.cat((p, cont[i])).unsqueeze(0), return_routes=True)
            assert torch.allclose(logits[i], full.logits[0], atol=1e-4, rtol=0), i
            assert torch.equal(routes[i], full.routes[0]), i


def test_kv_cached_ragged_decoding_bf16(cfg, m16):
    """bf16: cached decode vs full forward. GEMMs of different M and softmax over rows of a different length may
    round differently in the last bf16 bit, which can then flip a routing choice; we require most rows equal and
    every row close in probability space."""
    prompts = _ragged(cfg, [5, 11, 3], seed=5)
    cont = torch.randint(1, cfg.vocab_size, (3, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits, _ = _cached_decode(m16, prompts, cont)
        equal_rows = total_rows = 0
        for i, p in enumerate(prompts):
            full = m16(torch.cat((p, cont[i])).unsqueeze(0)).logits[0]
            equal_rows += int((logits[i] == full).all(-1).sum())
            total_rows += full.shape[0]
            tv = 0.5 * (logits[i].softmax(-1) - full.softmax(-1)).abs().sum(-1)
            assert tv.max() < 0.05, tv.max()
    assert equal_rows >= 0.5 * total_rows, (equal_rows, total_rows)


def test_padding_is_invisible_and_positions_follow_real_tokens(cfg, m32):
    prompts = _ragged(cfg, [4, 9], seed=7)
    ids, mask = _left_pad(prompts)
    ids[0, : 9 - 4] = 17  # padding content must not matter
    with torch.no_grad():
        out = m32(ids, attention_mask=mask)
        for i, p in enumerate(prompts):
            alone = m32(p.unsqueeze(0)).logits[0]
            assert torch.allclose(out.logits[i, mask[i]], alone, atol=1e-5, rtol=0)


def test_packed_equals_separate_sequences(cfg, m32):
    seqs = _ragged(cfg, [5, 12, 3], seed=8)
    cu = torch.tensor([0, 5, 17, 20])
    packed = torch.cat(seqs).unsqueeze(0)
    with torch.no_grad():
        out = m32(packed, cu_seqlens=cu, return_routes=True)
        lp = m32.token_logprobs(packed, cu_seqlens=cu)
        for i, s in enumerate(seqs):
            alone = m32(s.unsqueeze(0), return_routes=True)
            seg = slice(cu[i].item(), cu[i + 1].item())
            assert torch.allclose(out.logits[0, seg], alone.logits[0], atol=1e-5, rtol=0)
            assert torch.equal(out.routes[0, seg], alone.routes[0])
            assert torch.allclose(lp[0, cu[i]: cu[i + 1] - 1], m32.token_logprobs(s.unsqueeze(0))[0], atol=1e-5)
    assert lp[0, 4] == 0 and lp[0, 16] == 0  # boundary entries
    with pytest.raises(ValueError, match="cu_seqlens"):
        m32(packed, cu_seqlens=torch.tensor([0, 5, 19]))


def test_token_logprobs_temperature(cfg, m32):
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        lp = m32.token_logprobs(ids, temperature=0.7)
        logits = m32(ids).logits
        last = m32(ids, last_logits_only=True).logits
    assert last.shape == (2, 1, cfg.vocab_size) and torch.allclose(last, logits[:, -1:], atol=1e-5)
    manual = torch.log_softmax(logits[:, :-1].double() / 0.7, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert lp.shape == (2, 8) and lp.dtype == torch.float32
    assert torch.allclose(lp.double(), manual, atol=1e-5)


def test_kv_cache_grows_and_selects_rows(cfg, m32):
    prompts = _ragged(cfg, [3, 6], seed=10)
    ids, mask = _left_pad(prompts)
    cache = KVCache(cfg, 2, 2, torch.float32)  # too small on purpose: must grow
    with torch.no_grad():
        m32(ids, attention_mask=mask, kv_cache=cache)
        cache.select_rows([1])
        nxt = torch.tensor([[5]])
        o = m32(nxt, kv_cache=cache).logits[0, -1]
        full = m32(torch.cat((prompts[1], nxt[0])).unsqueeze(0)).logits[0, -1]
    assert cache.capacity >= 7
    assert torch.allclose(o, full, atol=1e-4)


def test_load_hf_tensors_partial_packed_and_errors(cfg):
    m = BeamForCausalLM(cfg, dtype=torch.bfloat16, seed=1)
    new = random_state_dict(cfg, seed=2, dtype=torch.bfloat16)
    layer = cfg.moe_layers[0]
    gate_up, down = packed_expert_names(layer)
    p = f"model.layers.{layer}.mlp.experts."
    E = cfg.num_experts
    packed = {
        gate_up: torch.stack([torch.cat((new[f"{p}{e}.gate_proj.weight"], new[f"{p}{e}.up_proj.weight"])) for e in range(E)]),
        down: torch.stack([new[f"{p}{e}.down_proj.weight"] for e in range(E)]),
        "lm_head.weight": new["lm_head.weight"],
    }
    updated = m.load_hf_tensors(packed)
    assert len(updated) == 3 * E + 1
    sd = m.state_dict()
    for name in updated:
        assert torch.equal(sd[name], new[name]), name
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(KeyError, match="model.layers.0.mlp.bogus.weight"):
        m.load_hf_tensors({"model.norm.weight": new["model.norm.weight"], "model.layers.0.mlp.bogus.weight": new["model.norm.weight"]})
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\).*\(64,\)"):
        m.load_hf_tensors({"model.norm.weight": torch.zeros(3)})
    router = f"model.layers.{layer}.mlp.gate.weight"
    with pytest.raises(ValueError, match="float32"):
        m.load_hf_tensors({router: new[router].to(torch.bfloat16)})
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # failed loads change nothing
    with pytest.raises(KeyError, match="missing"):
        m.load_hf_tensors({"model.norm.weight": new["model.norm.weight"]}, strict=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_equals_running_each_expert_on_its_tokens(cfg, m32, m16, dtype):
    """BeamMoE's grouped expert GEMMs give exactly what running `numerics.expert_output` expert by expert does."""
    from beamrl.models.beam import numerics

    moe = (m32 if dtype == torch.float32 else m16).model.layers[1].mlp
    x = torch.randn(29, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad():
        out, ids = moe(x)
        logits = numerics.router_logits(x, moe.gate.weight)
        weights, _ = numerics.grouped_topk(logits, moe.gate.e_score_correction_bias, cfg.num_experts_per_tok,
                                           cfg.n_group, cfg.topk_group)
        per_pair = torch.zeros(*ids.shape, cfg.hidden_size, dtype=dtype)
        for e, ex in enumerate(moe.experts):
            rows, slots = (ids == e).nonzero(as_tuple=True)
            if rows.numel():
                per_pair[rows, slots] = numerics.expert_output(x[rows], ex.gate_proj.weight, ex.up_proj.weight,
                                                               ex.down_proj.weight, weights[rows, slots])
    assert torch.equal(out, numerics.moe_combine(per_pair, cfg.routed_scaling_factor))


def test_return_hidden_is_what_the_head_reads(cfg, m32):
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        plain = m32(ids)
        out = m32(ids, return_hidden=True)
    assert plain.hidden is None
    assert out.hidden.shape == (2, 7, cfg.hidden_size)
    head = numerics.softcap(torch.nn.functional.linear(out.hidden, m32.lm_head.weight), cfg.final_logit_softcapping)
    assert torch.equal(head, out.logits) and torch.equal(out.logits, plain.logits)


def test_moe_uses_the_current_expert_parameters_after_they_are_replaced(cfg):
    """The MoE layers look their expert Parameters up once; replacing them (load_state_dict(assign=True), a
    `.to()` that builds new Parameters) must not leave a layer computing with the old ones."""
    new_sd = random_state_dict(cfg, seed=7, dtype=torch.float32)
    want = BeamForCausalLM(cfg, dtype=torch.float32, seed=7)
    ids = torch.randint(1, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    model = BeamForCausalLM(cfg, dtype=torch.float32, seed=0)
    model.load_state_dict(new_sd, assign=True)
    assert torch.equal(model(ids).logits, want(ids).logits)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(torch.bfloat16)  # new Parameter objects
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    moe = next(layer.mlp for layer in model.model.layers if layer.is_moe)
    assert moe._gate_up_params[0] is moe.experts[0].gate_proj.weight
    assert moe._down_params[-1] is moe.experts[-1].down_proj.weight
    assert torch.equal(model(ids).logits, want.to(torch.bfloat16)(ids).logits)
