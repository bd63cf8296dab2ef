"""The driver's side of a sync: short probes (the last `PROBE_TOKENS` of prompt + answer + eos) and their tolerance
(exact 1e-4 only where trainer and engine compute the same thing: the native engine in float32)."""

from types import SimpleNamespace

from beamrl.data.digit_tokenizer import DigitTokenizer
from beamrl.data.sample import PromptSample
from beamrl.loop.weight_update import (
    ALARM_MAX_TOLERANCE,
    ALARM_MEAN_TOLERANCE,
    EXACT_TOLERANCE,
    PROBE_TOKENS,
    sync_probe,
    sync_request,
)
from beamrl.sync.config import SyncConfig


def _data(tok, prompt_lengths):
    samples = [PromptSample(f"p{i}", list(range(2, 2 + n)), "1+2=3", "s", index=i)
               for i, n in enumerate(prompt_lengths)]
    return SimpleNamespace(samples=samples)


def test_probes_are_two_short_tails_of_prompt_answer_and_eos():
    tok = DigitTokenizer()
    probe = sync_probe(_data(tok, [5, 300, 9]), tok, "float32", "native")
    answer = tok.encode("1+2=3") + [tok.eos_token_id]
    assert len(probe.sequences) == 2
    assert probe.sequences[0] == list(range(2, 7)) + answer  # short sample: all of it
    assert len(probe.sequences[1]) == PROBE_TOKENS and probe.sequences[1][-len(answer):] == answer


def test_tolerance_is_exact_only_where_both_sides_compute_the_same_thing():
    """Exact: every token within 1e-4. Elsewhere the alarm: the mean within 0.5 and every token within 3.0. Both
    bounds travel with the sync request to the orchestrator's `ProbeCheck`."""
    tok = DigitTokenizer()
    data = _data(tok, [4, 4])
    exact = sync_probe(data, tok, "float32", "native")
    assert (exact.tolerance, exact.mean_tolerance) == (EXACT_TOLERANCE, None)
    assert EXACT_TOLERANCE == 1e-4
    for dtype, engine in (("bfloat16", "native"), ("float32", "sglang"), ("bfloat16", "sglang")):
        alarm = sync_probe(data, tok, dtype, engine)
        assert (alarm.tolerance, alarm.mean_tolerance) == (ALARM_MAX_TOLERANCE, ALARM_MEAN_TOLERANCE)
        req = sync_request(3, SyncConfig(), 60.0, alarm)
        assert (req.probe_tolerance, req.probe_mean_tolerance) == (3.0, 0.5)
        check = req.probe_check()  # what the trainer ranks' orchestrator verifies with
        assert (check.tolerance, check.mean_tolerance) == (3.0, 0.5)


def test_colocated_engines_take_buckets_from_every_trainer_rank_where_rank_0_cannot_reach_them():
    """Per engine, the trainer rank on each of its TP ranks' devices, from the placement plan: for engines of TP > 1
    and for layouts over several nodes; () where trainer rank 0 ships every bucket (one node of TP-1 engines,
    disaggregated engines, other transports)."""
    from beamrl.loop.weight_update import rank_colocations
    from beamrl.recipe import load_recipe
    from beamrl.recipe.layout import placement_of

    def colocations(*overrides):
        r = load_recipe("quickstart", ["sft=null", "rollout.engine=sglang", *overrides])
        return rank_colocations(placement_of(r), r.sync.transport)

    two = ["cluster.gpus_per_node=2", "trainer.num_gpus=2", "trainer.micro_batch_size=32"]
    assert colocations(*two, "rollout.engine_tp=2") == ((0, 1),)
    assert colocations(*two, "rollout.num_engines=2") == ()  # one node, TP 1: rank 0's buffers reach both
    assert colocations("cluster.num_nodes=2", "trainer.num_gpus=2", "trainer.micro_batch_size=32",
                       "rollout.num_engines=2") == ((0,), (1,))  # the engine on node 1 reads rank 1's copy
    assert colocations(*two, "rollout.engine_tp=2", "sync.transport=disk") == ()
