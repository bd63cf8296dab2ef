"""The collector refuses rollout results from weights other than those the engines were last synced to (an engine
a sync did not reach would feed the trainer another policy's samples; the batch's `rollout/weight_version` metric
only showed the smallest version). The engine group is a stand-in; the real loop runs in the e2e tests."""

from types import SimpleNamespace

import pytest

from beamrl.loop.collect import PendingRollout, RolloutCollector
from beamrl.protocols.rollout import EngineError, GenerateResult


def _result(version):
    return GenerateResult([1, 2], [3], [-0.5], "stop", weight_version=version)


def test_results_from_another_weight_version_end_the_step_loudly():
    engines = SimpleNamespace(collect=lambda handle: [[_result(4), _result(3)]], recovery=None)
    collector = RolloutCollector(SimpleNamespace(recipe=SimpleNamespace()), engines)
    pending = PendingRollout(step=0, prompts=[], handle=None, started=0.0, data_state={}, version=4)
    with pytest.raises(EngineError, match=r"version\(s\) \[3\].*synced to version 4"):
        collector.finish(pending)


def _collector_with_real_rewards(components, outputs_per_group):
    """A collector whose engines (a stand-in) return `outputs_per_group` (token ids per sample) and whose rewards are
    the real `RewardManager` (worker processes) on a decoder that spells id 9 as "bad" and other ids as digits."""
    from beamrl.algorithms import AlgorithmConfig
    from beamrl.data.sample import PromptSample
    from beamrl.rewards import RewardManager, RewardPoolConfig

    results = [[GenerateResult([1, 2], ids, [-0.5] * len(ids), "stop", weight_version=0) for ids in group]
               for group in outputs_per_group]
    engines = SimpleNamespace(collect=lambda handle: results, recovery=None)
    recipe = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=3), algorithm=AlgorithmConfig())
    tokenizer = SimpleNamespace(decode=lambda ids: "".join("bad" if i == 9 else str(i) for i in ids))
    manager = RewardManager(components, RewardPoolConfig(num_workers=1))
    run = SimpleNamespace(recipe=recipe, tokenizer=tokenizer, rewards=manager)
    prompts = [PromptSample("p", [1, 2], "x", "d") for _ in outputs_per_group]
    pending = PendingRollout(step=0, prompts=prompts, handle=None, started=0.0, data_state={}, version=0)
    return RolloutCollector(run, engines), pending, manager


def test_samples_whose_skip_reward_failed_are_not_trained_on_and_their_groups_use_the_others():
    """on_error: skip means the sample has no valid reward: it is left out of the batch (before, it was trained on
    with the failed component counted 0, as a wrong answer), and its group's advantages come from the rest."""
    from beamrl.rewards import RewardComponentConfig

    fns = "tests.rewards.sample_reward_fns"
    comps = [RewardComponentConfig(name="len", fn=f"{fns}:needs_completion"),
             RewardComponentConfig(name="grade", fn=f"{fns}:raises_on_bad", on_error="skip")]
    collector, pending, manager = _collector_with_real_rewards(comps, [[[1], [9], [1, 2], [1, 2, 3]], [[9], [4]]])
    with manager:
        batch = collector.finish(pending)
    outputs = [r.result.output_ids for r in batch.rollouts]
    assert outputs == [[1], [1, 2], [1, 2, 3], [4]]  # both "bad" samples left out
    assert batch.metrics["rollout/reward_excluded_samples"] == 2.0
    assert [r.raw_reward for r in batch.rollouts] == [2.0, 3.0, 4.0, 2.0]  # len + 1 (grade) for the kept ones
    first = [r.advantage for r in batch.rollouts[:3]]  # group 0: normalised over its three kept samples
    assert first[0] < 0 < first[2] and first[1] == pytest.approx(0.0, abs=1e-6)
    assert batch.rollouts[3].advantage == 0.0  # group 1 has one sample left: no signal
    assert batch.metrics["reward/mean"] == pytest.approx(11.0 / 4)
    assert batch.metrics["reward/total/mean"] == pytest.approx(11.0 / 4)  # over the samples trained on


def test_a_step_whose_samples_were_all_left_out_gives_an_empty_batch_with_its_counts():
    """A skip component that failed on every sample (its breaker tripped on the whole batch, say) leaves nothing to
    train on: the batch is empty, with its counts, and the loop skips the update (before, the run ended there)."""
    from beamrl.rewards import RewardComponentConfig

    comps = [RewardComponentConfig(name="grade", fn="tests.rewards.sample_reward_fns:raises_on_bad",
                                   on_error="skip")]
    collector, pending, manager = _collector_with_real_rewards(comps, [[[9], [9]]])
    with manager:
        batch = collector.finish(pending)
    assert batch.rollouts == [] and batch.num_tokens == 0
    assert batch.metrics["rollout/reward_excluded_samples"] == 2.0 and batch.metrics["rollout/num_samples"] == 0.0
    assert batch.metrics["reward/grade/errors"] == 2.0 and "reward/mean" not in batch.metrics


def test_step_metrics_describe_the_samples_trained_on_after_shaping_and_dynamic_sampling():
    """reward/shaped_mean was taken before shaping (always equal to reward/mean) and rollout/num_samples before
    dynamic sampling dropped groups; time/rollout_s left out the extra rounds."""
    from beamrl.algorithms import AlgorithmConfig
    from beamrl.data.sample import PromptSample
    from beamrl.rewards import RewardComponentConfig, RewardManager, RewardPoolConfig

    fns = "tests.rewards.sample_reward_fns"
    comps = [RewardComponentConfig(name="len", fn=f"{fns}:needs_completion")]
    # group 0 is informative (lengths 1 and 3), groups 1 and 2 are not (length 2): dynamic sampling drops them; the
    # extra round's prompts get two responses of lengths 1 and 2 each (informative): one such group is kept
    main = [[GenerateResult([1, 2], [1], [-0.5], "stop", weight_version=0),
             GenerateResult([1, 2], [1, 2, 3], [-0.5] * 3, "length", weight_version=0)],
            [GenerateResult([1, 2], [4, 5], [-0.5] * 2, "stop", weight_version=0)] * 2,
            [GenerateResult([1, 2], [8, 9], [-0.5] * 2, "stop", weight_version=0)] * 2]
    extra = [[GenerateResult([1, 2], [6], [-0.5], "stop", weight_version=0),
              GenerateResult([1, 2], [6, 7], [-0.5] * 2, "stop", weight_version=0)]]
    calls = []

    def generate(groups, timeout):
        calls.append(len(groups))
        return extra * len(groups)

    engines = SimpleNamespace(collect=lambda handle: main, generate=generate, recovery=None)
    algorithm = AlgorithmConfig(overlong={"enabled": True, "buffer": 2, "penalty": 1.0},
                                dynamic_sampling={"enabled": True, "max_oversample_rounds": 1})
    recipe = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=3, n_samples_per_prompt=2, temperature=1.0,
                                                     top_p=1.0, top_k=-1, prompts_per_step=2),
                             algorithm=algorithm, run=SimpleNamespace(seed=0),
                             timeouts=SimpleNamespace(generate_s=60.0))
    prompt = PromptSample("p", [1, 2], "x", "d")
    data = SimpleNamespace(next_batch=lambda n: [prompt] * n)
    run = SimpleNamespace(recipe=recipe, tokenizer=SimpleNamespace(decode=lambda ids: "".join(map(str, ids))),
                          rewards=RewardManager(comps, RewardPoolConfig(num_workers=1)), data=data, stop_ids=(0,),
                          return_routed_experts=False)
    pending = PendingRollout(step=0, prompts=[prompt] * 3, handle=None, started=0.0, data_state={}, version=0)
    with run.rewards:
        batch = RolloutCollector(run, engines).finish(pending)
    assert len(calls) == 1  # one extra round
    assert batch.metrics["reward/mean"] == 2.0  # the main round: lengths 1, 3, 2, 2, 2, 2
    assert batch.metrics["rollout/num_samples"] == len(batch.rollouts) == 4  # group 0 and the extra group
    shaped = [r.reward for r in batch.rollouts]
    assert batch.metrics["reward/shaped_mean"] == pytest.approx(sum(shaped) / 4)
    assert batch.metrics["reward/shaped_mean"] < sum(r.raw_reward for r in batch.rollouts) / 4  # penalised
    assert batch.metrics["throughput/rollout_tokens_per_s"] > 0
