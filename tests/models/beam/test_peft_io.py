"""PEFT-format adapters: the `peft` library loads beamrl's files onto the reference model (every target module
wrapped, the tensors as written), import round-trips them (shared expert A included), and the trainer's adapter
loaded with `peft` reproduces the trainer's logprobs."""

import json

import peft
import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.lora import adapted_weights, random_adapter
from beamrl.models.beam.lora_config import ALL_TARGETS, ATTENTION_TARGETS, LoRAConfig
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.models.beam.peft_io import PeftAdapterError, load_peft_adapter, save_peft_adapter

LOGPROB_TOL = 1e-5


def small():
    return preset("tiny").replace(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                  mlp_layer_types=["dense", "sparse"])


@pytest.mark.parametrize("share", [False, True])
def test_peft_wraps_every_target_with_our_tensors_and_import_round_trips(tmp_path, share):
    cfg = small()
    lora = LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS, share_expert_a=share)
    adapter = random_adapter(cfg, lora, seed=1)
    save_peft_adapter(tmp_path, adapter, lora, cfg)
    model = peft.PeftModel.from_pretrained(BeamForCausalLM(cfg, dtype=torch.float32, seed=0), str(tmp_path))
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    expected = adapted_weights(cfg, lora)
    assert wrapped == {w.weight.removesuffix(".weight") for w in expected}
    params = dict(model.named_parameters())
    for w in expected:
        module = "base_model.model." + w.weight.removesuffix(".weight")
        assert torch.equal(params[module + ".lora_A.default.weight"], adapter[w.a])
        assert torch.equal(params[module + ".lora_B.default.weight"], adapter[w.b])
    lora2, back = load_peft_adapter(tmp_path, cfg)
    assert lora2 == lora and back.keys() == adapter.keys()
    assert all(torch.equal(back[k], v) for k, v in adapter.items())


def test_import_without_the_beamrl_side_file_and_bad_inputs(tmp_path):
    cfg = small()
    lora = LoRAConfig(rank=2, alpha=3.0, targets=ATTENTION_TARGETS)
    adapter = random_adapter(cfg, lora, seed=2)
    save_peft_adapter(tmp_path, adapter, lora, cfg)
    (tmp_path / "beamrl_lora.json").unlink()
    lora2, back = load_peft_adapter(tmp_path, cfg)
    assert (lora2.rank, lora2.alpha, lora2.targets) == (2, 3.0, ATTENTION_TARGETS)
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**conf, "use_rslora": True}))
    with pytest.raises(PeftAdapterError, match="rsLoRA"):
        load_peft_adapter(tmp_path, cfg)
    with pytest.raises(PeftAdapterError, match="missing"):
        save_peft_adapter(tmp_path / "x", {k: v for k, v in list(adapter.items())[1:]}, lora, cfg)


@pytest.mark.slow
def test_trainer_adapter_loaded_with_peft_reproduces_the_trainer(tmp_path):
    from beamrl.trainer.megatron.launch import launch

    from ...trainer.megatron import _lora_equivalence as L

    got = launch(L.peft_round_trip, 1, (str(tmp_path),), timeout_s=300)[0]
    assert got["reloaded_equal"]
    assert got["reloaded_logprobs"] == got["logprobs"]
    reference = BeamForCausalLM(got["config"], dtype=torch.float32, seed=None)
    reference.load_hf_tensors(got["base"], strict=True)
    model = peft.PeftModel.from_pretrained(reference, str(tmp_path)).merge_and_unload()
    lps = [model.token_logprobs(torch.tensor([p]))[0].tolist() for p in L.PROBES]
    delta = max(abs(a - b) for xs, ys in zip(lps, got["logprobs"]) for a, b in zip(xs, ys))
    assert delta <= LOGPROB_TOL, delta
    base = BeamForCausalLM(got["config"], dtype=torch.float32, seed=None)
    base.load_hf_tensors(got["base"], strict=True)
    plain = [base.token_logprobs(torch.tensor([p]))[0].tolist() for p in L.PROBES]
    assert max(abs(a - b) for xs, ys in zip(plain, got["logprobs"]) for a, b in zip(xs, ys)) > 100 * LOGPROB_TOL
