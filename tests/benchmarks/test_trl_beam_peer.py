"""benchmarks/trl_beam_peer.py: the Beam reference model behind the transformers interface that TRL drives. It must
be the very model and init beamrl starts from, and hand TRL's fused LM head the hidden state the head reads.
(Runs in .venv's transformers; TRL itself lives in .venv-trl and is not imported here.)"""

from __future__ import annotations

import dataclasses

import torch

from beamrl.data.digit_tokenizer import DigitTokenizer
from beamrl.models.beam import BeamForCausalLM, numerics, preset
from benchmarks import trl_vs_beamrl as bench
from benchmarks.trl_beam_peer import beam_peer

T = DigitTokenizer


def _peer(seed=0):
    return beam_peer(len(T.vocab), T.eos_token_id, T.pad_token_id, T.bos_token_id, seed=seed)


def _batch():
    ids = torch.tensor([[1, 1, 5, 13, 6, 14], [5, 13, 6, 14, 7, 9]])  # left padding in row 0
    return ids, (ids != T.pad_token_id).long()


def test_same_model_and_init_as_beamrls_random_checkpoint():
    peer = _peer()
    ref = BeamForCausalLM(dataclasses.replace(preset("tiny"), vocab_size=len(T.vocab)), torch.float32, seed=0)
    mine = {n.removeprefix("beam."): p for n, p in peer.named_parameters()}
    theirs = dict(ref.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(p, theirs[n]) for n, p in mine.items())
    assert sum(p.numel() for p in peer.parameters()) == bench.beam_tiny_params(len(T.vocab))
    ids, att = _batch()
    with torch.no_grad():
        assert torch.equal(peer(ids, attention_mask=att).logits, ref(ids, attention_mask=att).logits)
        assert torch.equal(peer(ids, attention_mask=att, logits_to_keep=2).logits,
                           ref(ids, attention_mask=att).logits[:, -2:])
    frozen = [n for n, p in peer.named_parameters() if not p.requires_grad]
    assert frozen and all(n.endswith("e_score_correction_bias") for n in frozen)  # as beamrl's trainer's buffer
    assert not torch.equal(_peer(seed=1).beam.lm_head.weight, peer.beam.lm_head.weight)


def test_backbone_hands_the_fused_head_what_the_lm_head_reads():
    # TRL's fused head calls model.base_model(...).last_hidden_state, applies get_output_embeddings() (weight,
    # bias) and config.final_logit_softcapping: that must give the model's own logits.
    peer = _peer()
    ids, att = _batch()
    head = peer.get_output_embeddings()
    assert head.bias is None and peer.base_model is peer.model
    with torch.no_grad():
        hidden = peer.base_model(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state
        logits = numerics.softcap(torch.nn.functional.linear(hidden, head.weight), peer.config.final_logit_softcapping)
        assert torch.equal(logits, peer(ids, attention_mask=att).logits)


def test_generate_without_cache_is_the_models_greedy_continuation():
    peer = _peer()
    ids, att = _batch()
    ids, att = ids[:, :4], att[:, :4]
    out = peer.generate(input_ids=ids, attention_mask=att, max_new_tokens=3, do_sample=False,
                        pad_token_id=T.pad_token_id, eos_token_id=T.eos_token_id)
    seq, mask = ids, att
    with torch.no_grad():
        for _ in range(3):  # left padding: positions come from the mask, as in beamrl's engine
            nxt = peer.beam(seq, attention_mask=mask).logits[:, -1].argmax(-1, keepdim=True)
            seq, mask = torch.cat([seq, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    for row in range(2):  # generate pads a row once it emitted eos: compare up to and including it
        want = seq[row, 4:].tolist()
        want = want[:want.index(T.eos_token_id) + 1] if T.eos_token_id in want else want
        assert out[row, 4:4 + len(want)].tolist() == want
