"""The data of one RL step: prompts -> samples on the engines -> raw rewards -> (dynamic sampling) -> shaped
rewards and advantages. `start` submits a step's generation; `finish` waits for it and does the rest, so a
one-step-off run can start step k+1 before training step k."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from beamrl.loop import step as S
from beamrl.loop.groups import EngineGroup
from beamrl.loop.rollouts import Rollout
from beamrl.loop.setup import RunContext
from beamrl.protocols.rollout import EngineError


@dataclass
class RolloutBatch:
    """A step's scored rollouts (with advantages) and their metrics."""

    rollouts: list[Rollout]
    metrics: dict[str, float]

    @property
    def num_tokens(self) -> int:
        """Prompt + response tokens of every sample."""
        return sum(r.prompt_len + r.response_len for r in self.rollouts)


@dataclass
class PendingRollout:
    """A step's generation submitted to the engines. `data_state` is the prompt loader's position before its
    prompts: a checkpoint taken while it is in flight resumes there, so its prompts are not skipped. `done` holds
    the finished batch once it was collected early (engines must be idle before a weight update)."""

    step: int
    prompts: list
    handle: Any  # EngineGroup.generate_async's
    started: float
    data_state: dict
    version: int  # the weight version the engines were synced to when it was submitted: every result's
    done: RolloutBatch | None = None


class RolloutCollector:
    """Generates, scores and shapes the batches of a run's steps on its engines."""

    def __init__(self, run: RunContext, engines: EngineGroup):
        self.run, self.engines = run, engines

    def start(self, step: int, version: int) -> PendingRollout:
        """Submit step `step`'s prompts; the engines serve weight `version` (checked on every result)."""
        r = self.run.recipe
        if self.engines.recovery is not None:  # a call boundary: restart dead engines before submitting
            self.engines.recovery.check()
        data_state = self.run.data.state_dict()
        prompts = self.run.data.next_batch(r.rollout.prompts_per_step)
        groups = S.make_requests(prompts, r.rollout, r.run.seed, step, 0, self.run.stop_ids,
                                 self.run.return_routed_experts)
        t0 = time.perf_counter()
        handle = self.engines.generate_async(groups, timeout=r.timeouts.generate_s)
        return PendingRollout(step, prompts, handle, t0, data_state, version)

    def collect_early(self, pending: PendingRollout) -> PendingRollout:
        """Finish `pending` now (before a weight update); `finish` then returns the stored batch."""
        pending.done = self.finish(pending)
        return pending

    def finish(self, pending: PendingRollout) -> RolloutBatch:
        if pending.done is not None:
            return pending.done
        r = self.run.recipe
        t_wait = time.perf_counter()
        results = self.engines.collect(pending.handle)
        wait_s = time.perf_counter() - t_wait  # < rollout_s when generation ran while the trainer trained
        _check_versions(results, pending.version)
        generated = S.to_rollouts(pending.prompts, results, 0)
        n_tokens = sum(x.response_len for x in generated)  # every response the engines produced, this round
        rollouts, n_aborted = S.drop_aborted(generated)
        metrics = S.score(rollouts, self.run.tokenizer, self.run.rewards)
        rollouts, n_excluded = S.drop_excluded(rollouts)
        metrics["rollout/aborted_groups"] = float(n_aborted)
        metrics["rollout/reward_excluded_samples"] = float(n_excluded)
        recovery = self.engines.recovery  # restarts while this batch was generated (dynamic sampling included)
        if not rollouts:  # every sample left out (on_error: skip): the loop skips this step's update
            metrics.update({"rollout/num_samples": 0.0, "time/rollout_s": time.perf_counter() - pending.started,
                            "time/rollout_wait_s": wait_s,
                            "engine/restarts": float(recovery.take_restarts() if recovery is not None else 0)})
            return RolloutBatch([], metrics)
        metrics["reward/mean"] = sum(x.raw_reward for x in rollouts) / len(rollouts)  # the main round's samples
        metrics.update(S.response_metrics(rollouts, r.rollout.max_new_tokens))
        if r.algorithm.dynamic_sampling.enabled:
            rollouts, ds_metrics, ds_excluded, ds_tokens = self._dynamic_sampling(rollouts, pending)
            metrics.update(ds_metrics)
            metrics["rollout/reward_excluded_samples"] += ds_excluded  # left out in the extra rounds
            n_tokens += ds_tokens
        S.shape_and_advantages(rollouts, r.algorithm, r.rollout.max_new_tokens)
        metrics.update(S.trained_metrics(rollouts))
        gen_s = time.perf_counter() - pending.started  # every round of generation (and its rewards)
        metrics.update({"time/rollout_s": gen_s, "time/rollout_wait_s": wait_s,
                        "throughput/rollout_tokens_per_s": n_tokens / max(gen_s, 1e-9),
                        "rollout/weight_version": float(min(x.result.weight_version for x in rollouts))})
        metrics["engine/restarts"] = float(recovery.take_restarts() if recovery is not None else 0)
        return RolloutBatch(rollouts, metrics)

    def _dynamic_sampling(self, rollouts: list[Rollout], pending: PendingRollout):
        """Keep groups with informative raw rewards; over-sample more prompts for up to N extra rounds. Returns the
        kept rollouts, the metrics, how many samples of the extra rounds were left out (on_error: skip) and how many
        response tokens the extra rounds generated."""
        r = self.run.recipe
        target = r.rollout.prompts_per_step
        kept, res = S.keep_informative_groups(rollouts, target, 0)
        metrics = dict(res.metrics)
        next_group = len(pending.prompts)
        excluded = tokens = 0
        for round_ in range(1, r.algorithm.dynamic_sampling.max_oversample_rounds + 1):
            if res.num_needed == 0:
                break
            more = self.run.data.next_batch(max(1, res.suggested_num_prompts))
            groups = S.make_requests(more, r.rollout, r.run.seed, pending.step, round_, self.run.stop_ids,
                                     self.run.return_routed_experts)
            results = self.engines.generate(groups, timeout=r.timeouts.generate_s)
            _check_versions(results, pending.version)
            generated = S.to_rollouts(more, results, next_group)
            tokens += sum(x.response_len for x in generated)
            extra, _ = S.drop_aborted(generated)
            next_group += len(more)
            S.score(extra, self.run.tokenizer, self.run.rewards)
            extra, n_left_out = S.drop_excluded(extra)  # as in the first round
            excluded += n_left_out
            if not extra:
                continue
            new, res = S.keep_informative_groups(extra, target, len({x.group for x in kept}))
            kept += new
        metrics["dynamic_sampling/groups_kept"] = float(len({x.group for x in kept}))
        if not kept:  # nothing informative at all: train on the original batch (advantages are all zero)
            kept = rollouts
        return kept, metrics, float(excluded), tokens


def _check_versions(results, version: int) -> None:
    """Every result comes from weights `version`: an engine that serves others (a sync that did not reach it) must
    not feed the trainer samples of another policy unnoticed."""
    wrong = sorted({r.weight_version for group in results for r in group if r.weight_version != version})
    if wrong:
        raise EngineError(f"rollout results from weight version(s) {wrong}, but the engines were synced to version "
                          f"{version}: an engine serves weights the last sync did not give it")
