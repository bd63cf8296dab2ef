"""The repository's pure-PyTorch Beam reference model (`beamrl.models.beam`) as a transformers causal LM, so that
TRL's GRPOTrainer and the TRL side's SFT loop of `benchmarks/trl_vs_beamrl.py` can drive the very model (and
the very init) that beamrl trains (`--trl-model beam`).

Runs in `.venv-trl` (transformers 5.24, TRL 1.16): `beamrl.models.beam` needs only torch and safetensors, no
sglang, Megatron or Ray. The wrapper adds no math: logits are the reference model's softcapped FP32 logits, and
TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`) gets the final-norm hidden state through `model`
(the `base_model_prefix`), then applies the same `lm_head` and the config's `final_logit_softcapping`.
Generation runs without a KV cache (a prompt of <= 4 tokens and <= 3 new ones: a full forward per token).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from beamrl.models.beam import BeamForCausalLM, preset


class BeamPeerConfig(PretrainedConfig):
    """The few fields transformers, generate() and TRL read; the Beam shape comes from `preset` + `vocab_size`."""

    model_type = "beamrl_beam_peer"

    def __init__(self, preset: str = "tiny", vocab_size: int = 16, final_logit_softcapping: float | None = 30.0,
                 **kwargs):
        self.preset = preset
        self.vocab_size = vocab_size
        self.final_logit_softcapping = final_logit_softcapping
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def beam_config(self):
        return dataclasses.replace(preset(self.preset), vocab_size=self.vocab_size)


class _Backbone(torch.nn.Module):
    """Embeddings, decoder layers and final norm of the wrapped model: what TRL's fused LM head calls."""

    def __init__(self, beam: BeamForCausalLM):
        super().__init__()
        self._beam = [beam]  # a list: not a second registration of the same parameters

    def forward(self, input_ids, attention_mask=None, **_ignored) -> BaseModelOutput:
        out = self._beam[0](input_ids, attention_mask=attention_mask, return_hidden=True)
        return BaseModelOutput(last_hidden_state=out.hidden)


class BeamPeerForCausalLM(PreTrainedModel, GenerationMixin):
    """`BeamForCausalLM` behind the transformers interface. Positions come from the attention mask (left or right
    padding), as in the reference model; `position_ids` from generate() agree and are ignored."""

    config_class = BeamPeerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: BeamPeerConfig, seed: int = 0):
        super().__init__(config)
        beam_cfg = config.beam_config()
        if beam_cfg.final_logit_softcapping != config.final_logit_softcapping:
            raise ValueError(f"BeamPeerConfig.final_logit_softcapping={config.final_logit_softcapping} differs from "
                             f"the preset's {beam_cfg.final_logit_softcapping}")
        # beamrl's random checkpoint rule and seed (`weights.random_tensors`), FP32: the init beamrl starts from.
        self.beam = BeamForCausalLM(beam_cfg, dtype=torch.float32, device="cpu", seed=seed)
        self.beam.lm_head.bias = None  # TRL's fused head reads lm_head.bias; Beam's head has none
        self.model = _Backbone(self.beam)

    def _init_weights(self, module) -> None:  # the weights come from the seeded Beam rule above, never from HF
        pass

    def get_input_embeddings(self):
        return self.beam.model.embed_tokens

    def get_output_embeddings(self):
        return self.beam.lm_head

    def forward(self, input_ids, attention_mask=None, logits_to_keep: int = 0, **_ignored) -> CausalLMOutput:
        logits = self.beam(input_ids, attention_mask=attention_mask).logits
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutput(logits=logits)


def beam_peer(vocab_size: int, eos_token_id: int, pad_token_id: int, bos_token_id: int,
              seed: int = 0) -> BeamPeerForCausalLM:
    """tiny Beam at `vocab_size` from beamrl's random-checkpoint rule at `seed`, ready for TRL."""
    cfg = BeamPeerConfig(preset="tiny", vocab_size=vocab_size, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, bos_token_id=bos_token_id)
    model = BeamPeerForCausalLM(cfg, seed=seed)
    model.generation_config.use_cache = False
    return model
