"""The LoRA merge rule (fixed-order FP32, one rounding to W0's dtype), its sharding invariance, the adapter
config, the adapter payload's checks and the engine-side merger."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from beamrl.models.beam import lora as L
from beamrl.models.beam import preset
from beamrl.models.beam.lora_config import ALL_TARGETS, ATTENTION_TARGETS, LoRAConfig, LoRAConfigError
from beamrl.models.beam.lora_payload import SCALE_NAME, adapter_payload, adapter_table, scale_tensor
from beamrl.models.beam.lora_receiver import AdapterMerger, AdapterRejected


def _rule_in_numpy(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The contract written out with NumPy FP32 ufuncs, one operation at a time."""
    af, bf = a.float().numpy(), b.float().numpy()
    acc = bf[:, 0:1] * af[0:1, :]
    for r in range(1, af.shape[0]):
        acc = acc + bf[:, r:r + 1] * af[r:r + 1, :]
    acc = acc * np.float32(scale)
    acc = acc + w0.float().numpy()
    return torch.from_numpy(acc).to(w0.dtype)


def _factors(out=48, inp=40, r=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(out, inp, generator=g).to(dtype)
    a = (torch.randn(r, inp, generator=g) * 0.3).to(dtype)
    b = (torch.randn(out, r, generator=g) * 0.3).to(dtype)
    return w0, a, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_is_the_fixed_order_rule_bit_for_bit(dtype):
    w0, a, b = _factors(dtype=dtype)
    s = LoRAConfig(rank=8, alpha=3.0).scale
    got = L.merge_lora_weight(w0, a, b, s)
    assert got.dtype == dtype and torch.equal(got, _rule_in_numpy(w0, a, b, s))
    # Not what a GEMM computes (the rule is pinned, not "some merge"): in FP32 at least one element differs.
    gemm = (w0.float() + s * (b.float() @ a.float())).to(dtype)
    if dtype == torch.float32:
        assert not torch.equal(got, gemm)


def test_sharded_merges_equal_the_full_merge_bit_for_bit(monkeypatch):
    w0, a, b = _factors(out=64, inp=48, r=6)
    s = 0.75
    full = L.merge_lora_weight(w0, a, b, s)
    rows = torch.cat([L.merge_lora_weight(w0[i:i + 16], a, b[i:i + 16], s) for i in range(0, 64, 16)])
    cols = torch.cat([L.merge_lora_weight(w0[:, j:j + 12], a[:, j:j + 12], b, s) for j in range(0, 48, 12)], dim=1)
    assert torch.equal(rows, full) and torch.equal(cols, full)
    monkeypatch.setattr(L, "_MERGE_CHUNK_ELEMENTS", 100)  # internal chunking is elementwise too
    assert torch.equal(L.merge_lora_weight(w0, a, b, s), full)
    # Experts: a batch of [E, out, in] equals each expert on its own; a shared A broadcasts.
    ws, as_, bs = zip(*(_factors(out=16, inp=12, r=4, seed=e) for e in range(3)))
    batched = L.merge_lora_weight(torch.stack(ws), torch.stack(as_), torch.stack(bs), s)
    assert all(torch.equal(batched[e], L.merge_lora_weight(ws[e], as_[e], bs[e], s)) for e in range(3))
    shared = L.merge_lora_weight(torch.stack(ws), as_[0], torch.stack(bs), s)
    assert all(torch.equal(shared[e], L.merge_lora_weight(ws[e], as_[0], bs[e], s)) for e in range(3))


def test_merge_refuses_bad_shapes_and_non_fp32_scales():
    w0, a, b = _factors()
    with pytest.raises(ValueError, match="do not fit"):
        L.merge_lora_weight(w0, a[:, :-1], b, 1.0)
    with pytest.raises(ValueError, match="FP32"):
        L.merge_lora_weight(w0, a, b, 0.1)


def test_lora_config_names_the_bad_field():
    for kwargs, field in [({"rank": 0}, "rank"), ({"alpha": -1.0}, "alpha"), ({"targets": ("mlp.gate",)}, "targets[0]"),
                          ({"targets": ()}, "targets"), ({"dropout": 0.1}, "dropout"),
                          ({"share_expert_a": True}, "share_expert_a"), ({"seed": -2}, "seed")]:
        with pytest.raises(ValidationError) as err:
            LoRAConfig(**kwargs)
        cause = err.value.errors()[0]["ctx"]["error"]
        assert isinstance(cause, LoRAConfigError) and cause.path == field, (kwargs, cause)
    with pytest.raises(ValidationError, match="rnak"):
        LoRAConfig.from_dict({"rnak": 4})
    assert LoRAConfig(rank=3, alpha=1.0).scale == np.float32(1 / 3)


def test_adapter_table_counts_the_501b_sizes():
    c = preset("beam-501b")
    attn = LoRAConfig(rank=32, targets=ATTENTION_TARGETS)
    assert L.adapter_num_parameters(c, attn) == 76_677_120
    experts = LoRAConfig(rank=32, targets=("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"))
    assert L.adapter_num_parameters(c, experts) == 32 * (5120 + 2560) * 3 * 256 * 49


def _merger(cfg, lora):
    store = {w.weight: torch.randn(w.out_features, w.in_features) for w in L.adapted_weights(cfg, lora)}
    written = {}
    merger = AdapterMerger(cfg, lora, lambda n: store[n], lambda named: written.update(dict(named)))
    return merger, store, written


def test_merger_applies_only_complete_checked_adapters_at_commit():
    cfg = preset("tiny").replace(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                 mlp_layer_types=["dense", "sparse"])
    lora = LoRAConfig(rank=2, alpha=4.0, targets=ALL_TARGETS)
    merger, store, written = _merger(cfg, lora)
    assert set(adapter_table(cfg, lora, torch.float32)) == merger.names
    adapter = L.random_adapter(cfg, lora, 1)
    payload = adapter_payload(adapter, lora)
    merger.stage(payload[5:])
    merger.stage(payload[:5])  # the scale starts a new adapter: what was staged before is forgotten
    with pytest.raises(AdapterRejected, match="incomplete adapter"):
        merger.commit()
    assert not written and merger.applied is None
    merger.stage(list(reversed(payload)))  # any order inside a bucket: the scale is taken first
    assert not written  # staged, nothing written before commit
    merger.commit()
    assert merger.num_applied == 1
    for w in L.adapted_weights(cfg, lora):
        assert torch.equal(written[w.weight], L.merge_lora_weight(store[w.weight], adapter[w.a], adapter[w.b],
                                                                  lora.scale))
    # Another scale (the engine's trainer.lora differs from the trainer's): refused, nothing written.
    written.clear()
    other = LoRAConfig(rank=2, alpha=2.0, targets=ALL_TARGETS)
    with pytest.raises(AdapterRejected, match="scale"):
        merger.stage(adapter_payload(adapter, other))
    with pytest.raises(AdapterRejected, match="not an adapter tensor"):
        merger.stage([(SCALE_NAME, scale_tensor(lora)), ("model.layers.0.mlp.gate.lora_A.weight", torch.zeros(2))])
    assert not written and merger.num_applied == 1
    # A new base (W0) under an applied adapter: reapply merges it over the new W0.
    name = next(iter(store))
    store[name] = torch.randn_like(store[name])
    merger.reapply([name])
    w = next(w for w in L.adapted_weights(cfg, lora) if w.weight == name)
    assert torch.equal(written[name], L.merge_lora_weight(store[name], adapter[w.a], adapter[w.b], lora.scale))


# Run where compiling is on (the suite sets TORCHDYNAMO_DISABLE=1): importing the module must not import torch's
# compiler (start-up of every driver and engine), and a compiled caller must run the merge eagerly (no graph holds its
# multiply and add, which a compiler could contract into an FMA).
_NEVER_COMPILED = """
import sys
import torch
from beamrl.models.beam.lora import merge_lora_weight
assert "torch._dynamo" not in sys.modules, "importing the LoRA merge imported torch's compiler"
graphs = []
def backend(gm, example_inputs):
    graphs.append(sorted({str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}))
    return gm.forward
def f(w0, a, b):
    return merge_lora_weight(w0, a, b, 2.0) * 3
w0, a, b = torch.randn(8, 4), torch.randn(2, 4), torch.randn(8, 2)
out = torch.compile(f, backend=backend)(w0, a, b)
assert torch.equal(out, f(w0, a, b))
assert graphs == [["<built-in function mul>"]], graphs
"""


def test_the_merge_is_never_compiled_and_its_import_does_not_load_the_compiler():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    env["PYTHONPATH"] = str(root)
    p = subprocess.run([sys.executable, "-c", _NEVER_COMPILED], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
