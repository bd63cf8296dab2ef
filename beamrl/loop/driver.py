"""`RLDriver`: runs a recipe. One step = rollout -> rewards -> (dynamic sampling) -> advantages -> train ->
weight sync (new version) -> metrics (-> checkpoint). Colocated mode alternates generation and training on the
same devices; disaggregated one-step-off mode generates step k+1 while step k trains (importance correction
against the rollout logprobs is then required by the recipe rules).

The pieces live beside this file: `setup` (run set-up, Ray, actors), `sft` (warm start), `collect` (a step's
rollouts, rewards, dynamic sampling, advantages), `train` (optimizer steps and micro-batches), `weight_update`
(the weight sync and its verification), `checkpoints` and `summary`."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from beamrl.cluster.report import format_placement
from beamrl.loop import TrainerRankLost
from beamrl.loop.checkpoints import RunCheckpoints, published, restore_driver_state, save_due, step_of
from beamrl.loop.collect import PendingRollout, RolloutBatch, RolloutCollector
from beamrl.loop.colocated import ColocatedMemory, engines_stage_memory, trainer_sleeps
from beamrl.loop.engine_recovery import EngineRecovery
from beamrl.loop.groups import CarriedSync, EngineGroup, TrainerGroup, TrainerRankError, first_line, open_express
from beamrl.loop.log import log
from beamrl.loop.ray_utils import ActorCallError
from beamrl.loop.run_dir import ADAPTER_DIR, plan_start
from beamrl.loop.samples import completion_samples
from beamrl.loop.setup import (Resources, RunContext, engine_start_bound_s,
                               engines_start_with_trainer, prepare_run, start_engines, start_ray, start_trainer,
                               truncate_step_files)
from beamrl.loop.sft import sft_warm_start
from beamrl.loop.summary import plot_and_summarize
from beamrl.loop.train import train_on_rollouts
from beamrl.loop.weight_sync import SyncRequest
from beamrl.loop.weight_update import (SyncProbe, publish_weights, rank_colocations, resync_engine, sync_probe,
                                       sync_request)
from beamrl.metrics import keys
from beamrl.metrics.samples import samples_due
from beamrl.recipe.schema import Recipe
from beamrl.trainer.batching import trainable


def _shutdown_once_started(starting, bound_s: float) -> None:
    """Release an engine group whose start ran in the background: wait for it (at most `bound_s`, what its own
    start-up timeouts allow), then shut down what started. A failed start released its own engines."""
    try:
        group = starting.result(timeout=bound_s)
    except TimeoutError:
        log(f"the engines' start did not end within {bound_s:g} s; engines it still starts are not shut down by "
            f"this run (their actors end with its Ray instance)")
        return
    except Exception:  # noqa: BLE001 - a failed start released its own engines (EngineGroup)
        return
    group.shutdown()


class RLDriver:
    """Owns the actors of a run and the step loop. Use as a context manager so everything is always released."""

    def __init__(self, recipe: Recipe, resume: bool = False, overwrite: bool = False, verbose: bool = False):
        self.recipe, self.resume, self.overwrite, self.verbose = recipe, resume, overwrite, verbose
        self.resources = Resources()
        self.ctx: RunContext | None = None
        self.trainer: TrainerGroup | None = None
        self.reference: TrainerGroup | None = None
        self.engines: EngineGroup | None = None
        self.collector: RolloutCollector | None = None
        self.probe: SyncProbe | None = None  # post-sync verification (sync.verify)
        self.checkpoints: RunCheckpoints | None = None
        self.colocated: ColocatedMemory | None = None  # the devices' hand-over within a step (colocated)
        self.version = 0  # the weight version the engines serve
        # One step off: set while the trainer holds weights it trained but has not published yet (its step is done,
        # the overlapped rollout is being collected). A restart then can only be given those newer weights.
        self._trained_unpublished = False
        self._resynced_ahead = 0  # restarted engines given such weights in this step (rollout/resynced_ahead)
        self.colocations: tuple[tuple[int, ...], ...] = ()  # colocated buckets from every trainer rank (weight_update)

    def __enter__(self) -> "RLDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release everything, each piece on its own (engines, trainers, Ray, loggers, rewards)."""
        self.resources.close()

    # ------------------------------------------------------------------------------------------ the run
    def run(self) -> Path:
        r = self.recipe
        t0 = time.perf_counter()
        start = plan_start(r, self.resume, self.overwrite, log)  # refuse / resume / replace: nothing written yet
        if start.completed:
            log(f"run {r.run.name!r} is complete: {start.resume_dir} covers its {r.run.num_steps} steps; nothing to "
                "do (raise run.num_steps to train further)")
            return start.out_dir
        run = self.ctx = prepare_run(r, start, self.resources)  # start-up checks: a bad field fails before Ray
        self.checkpoints = RunCheckpoints(run.checkpoint_root, r.checkpoint.keep_last, r.checkpoint.async_save,
                                          r.timeouts.checkpoint_s, log)
        for line in format_placement(run.placement).splitlines():  # every console line of beamrl's own is prefixed
            log(line)
        log(f"starting Ray ({'a local instance' if run.cpu else 'joining the cluster'})")
        start_ray(run, self.resources, self.verbose)
        policy = run.initial_checkpoint
        # A resumed run loads every trainer weight from its checkpoint and a full sync brings the engines there;
        # a LoRA run syncs only adapters, so its engines must start from the base it trains on (the SFT export,
        # reused when the run already wrote it).
        if r.sft is not None and (run.resume_dir is None or r.trainer.lora is not None):
            policy = sft_warm_start(run)
        log(f"starting the trainer ({r.trainer.num_gpus} Megatron rank(s)) and {r.rollout.num_engines} "
            f"{r.rollout.engine} engine(s) from {policy}")
        self._start_trainer_and_engines(policy)
        log(open_express([g for g in (self.trainer, self.reference) if g is not None], self.engines,
                         r.placement.express_calls))
        EngineRecovery(self.engines, self._resync_engine, max_restarts=r.rollout.max_engine_restarts,
                       interval_s=r.rollout.health_check_interval_s, health_timeout_s=r.timeouts.health_s, log=log)
        self.collector = RolloutCollector(run, self.engines)
        self.colocated = ColocatedMemory([g for g in (self.trainer, self.reference) if g is not None], self.engines,
                                         sleep=trainer_sleeps(r), staged=engines_stage_memory(r),
                                         timeout=r.timeouts.train_step_s)
        self.colocations = rank_colocations(run.placement, r.sync.transport)
        if r.sync.verify:
            self.probe = sync_probe(run.data, run.tokenizer, r.model.dtype, r.rollout.engine)
        try:
            start_step = self._resume() if run.resume_dir is not None else 0
            log(f"training steps {start_step + 1}..{r.run.num_steps} (one line per step; sampled completions every "
                f"{r.logging.samples.every_n_steps} steps)" if r.logging.samples.every_n_steps else
                f"training steps {start_step + 1}..{r.run.num_steps} (one line per step)")
            self._steps(start_step)
            self._finish(time.perf_counter() - t0)
        except TrainerRankError as e:
            raise self._rank_lost(e) from None
        return run.out_dir

    def _rank_lost(self, err: TrainerRankError) -> TrainerRankLost:
        """A dead trainer rank ends the run: the ranks are killed at once (live ones may be blocked in a collective
        with it; the engines are shut down on the way out) and the message says where to resume from."""
        self.trainer.kill()
        if self.reference is not None:
            self.reference.kill()
        last = published(self.ctx.checkpoint_root)
        where = (f"resume from checkpoint {last[-1]} with `beamrl train <recipe> --resume`" if last else
                 f"no checkpoint under {self.ctx.checkpoint_root} yet: start the run again")
        return TrainerRankLost(f"{err}; {where}")

    def _steps(self, start_step: int) -> None:
        """The RL loop, one step per iteration (see the module docstring)."""
        r = self.recipe
        one_step_off = r.placement.off_policy_steps == 1
        coloc = self.colocated  # colocated: the trainer sleeps during rollout, the engines during training
        pending: PendingRollout | None = None
        for step in range(start_step, r.run.num_steps):
            t0 = time.perf_counter()
            memory = coloc.before_rollout()
            batch = self.collector.finish(pending if pending is not None else self.collector.start(step, self.version))
            last = step + 1 == r.run.num_steps
            pending = self.collector.start(step + 1, self.version) if one_step_off and not last else None  # overlaps
            memory.update(coloc.before_train())
            metrics = {**batch.metrics, **memory, **self._train_and_publish(step, batch, pending, coloc.staged)}
            if one_step_off:
                metrics.setdefault("rollout/resynced_ahead", 0.0)
            metrics[keys.TIME_STEP] = time.perf_counter() - t0
            metrics[keys.TOKENS_PER_S] = batch.num_tokens / max(metrics[keys.TIME_STEP], 1e-9)
            self.ctx.logger.log(step, metrics)
            if batch.rollouts:
                self._show_samples(step, batch)
            self.checkpoints.poll(self.trainer)  # publish a background save as soon as it is complete
            if save_due(step + 1, r.checkpoint.every_n_steps, r.run.num_steps):
                self._save(step + 1, pending)

    # ------------------------------------------------------------------------------------------ pieces
    def _train_and_publish(self, step: int, batch: RolloutBatch, pending: PendingRollout | None,
                           staged: bool) -> dict[str, float]:
        """Train on `batch` and publish the weights as version step + 1; returns the train and sync metrics. With a
        rollout in flight (one step off) it is collected in between: the engines must be idle to update.

        A batch with too few samples left for the layout's micro-batches (`trainable`: samples whose rewards failed
        under on_error: skip were left out, maybe all) trains nothing, and the unchanged weights are published all the
        same: versions stay one per step, and on colocated GPUs the sync is
        what gives the engines their weights back after the hand-over."""
        # Nothing runs between the train step and the sync unless a rollout is in flight (one step off): then
        # the last train step's call carries the sync too (one round trip fewer).
        request = self._sync_request(step + 1, staged)
        tr = self.recipe.trainer
        trains = trainable(len(batch.rollouts), tr.global_batch_size, tr.micro_batch_size, self.trainer.dp_size,
                           tr.pp if tr.vpp else 1)
        if trains:
            metrics, carried = self._train(batch, request if pending is None else None)
        else:
            log(f"step {step + 1}: {len(batch.rollouts)} sample(s) left, too few for this layout's micro-batches "
                f"(samples whose reward failed under on_error='skip' were left out; the reward lines above say "
                f"which and why): no update this step; the unchanged weights are published as version {step + 1}")
            metrics, carried = {}, None
        if pending is not None:  # collect step k+1 (it sampled version k) before the update
            self._trained_unpublished = trains
            try:
                self.collector.collect_early(pending)
            finally:
                self._trained_unpublished = False
            # on step k+1's row, with the restarts of its rollout (engine/restarts)
            pending.done.metrics["rollout/resynced_ahead"], self._resynced_ahead = float(self._resynced_ahead), 0
        published = self._publish(request, carried)
        published["engine/restarts"] += batch.metrics.get("engine/restarts", 0.0)  # (the rollout's, with the sync's)
        return {**metrics, **published}

    def _start_trainer_and_engines(self, policy: str) -> None:
        """The trainer (and the KL reference), and the engines from `policy`. The engines start while the trainer
        does (each start is mostly process start-up, imports and waits: seconds per run), except on shared GPUs
        (`engines_start_with_trainer`). The engines are owned from the moment their start is submitted, so they are
        released whichever start fails, also on Ctrl-C; when both fail, the trainer's error is raised and the
        engines' is logged."""
        r, run = self.recipe, self.ctx
        if not engines_start_with_trainer(r):
            self._start_trainers(policy)
            self.engines = self._own("engines", start_engines(run, policy))
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="beamrl-engine-start")
        engines = pool.submit(start_engines, run, policy)
        pool.shutdown(wait=False)  # the thread ends with the start (bounded by its own timeouts)
        bound_s = engine_start_bound_s(r)
        self.resources.add("engines", lambda: _shutdown_once_started(engines, bound_s))
        try:
            self._start_trainers(policy)
        except Exception:
            try:  # the engines' own outcome, once their start ends (its timeouts bound the wait)
                err = engines.exception(timeout=bound_s)
            except Exception:  # noqa: BLE001 - still starting: released (waited for) with the resources
                err = None
            if err is not None:
                log(f"the engines failed to start too: {type(err).__name__}: {err}")
            raise
        self.engines = engines.result(timeout=bound_s)
        self.resources.move_to_end("engines")  # released before the trainer, as when they started after it

    def _start_trainers(self, policy: str) -> None:
        r, run = self.recipe, self.ctx
        self.trainer = self._own("trainer", start_trainer(run, policy))
        if r.algorithm.kl.reference:  # the reference is the policy's starting point (after SFT, also on resume)
            sft_out = run.out_dir / "sft_checkpoint"
            reference = str(sft_out) if r.sft is not None and (sft_out / "config.json").exists() else policy
            self.reference = self._own("reference", start_trainer(run, reference, reference=True))

    def _own(self, name: str, group):
        self.resources.add(name, group.shutdown)
        return group

    def _train(self, batch: RolloutBatch, then_sync: SyncRequest | None) -> tuple[dict[str, float],
                                                                                  CarriedSync | None]:
        r = self.recipe
        return train_on_rollouts(batch.rollouts, trainer=self.trainer, reference=self.reference,
                                 trainer_config=r.trainer, algorithm=r.algorithm, temperature=r.rollout.temperature,
                                 model=self.ctx.model, replay=self.ctx.routing_replay,
                                 then_sync=(self.engines, then_sync) if then_sync is not None else None)

    def _sync_request(self, version: int, staged: bool) -> SyncRequest:
        r = self.recipe
        resume = self.colocated.resume_after_sync if self.colocated is not None else ()
        return sync_request(version, r.sync, r.timeouts.sync_s, self.probe, staged, resume, self.colocations)

    def _resync_engine(self, index: int) -> None:
        """Bring restarted engine `index` to the weights the others serve (`EngineRecovery`'s resync).

        One step off, while the overlapped rollout is collected after a train step, the trainer no longer holds
        the weights the others serve: the restarted engine gets the trainer's newer ones under the served version
        (the label the rollout checks), and its re-issued samples come from that newer policy. The importance
        correction weighs them by the engine's own logprobs, so the update stays sound; the console says so and
        `rollout/resynced_ahead` counts it, so the version label is not silently wrong."""
        r = self.recipe
        resync_engine(self.trainer, self.engines, index, self.version, r.sync, r.timeouts.sync_s, self.probe,
                      colocations=self.colocations)
        if self._trained_unpublished:
            self._resynced_ahead += 1
            log(f"{self.engines.names[index]}: restarted while the one-step-off rollout was collected, after the "
                f"trainer's step to version {self.version + 1}: it got those weights under version {self.version}, "
                f"and the requests it re-ran sampled that newer policy (importance-corrected with its own "
                f"logprobs, as every sample)")

    def _publish(self, request: SyncRequest, carried: CarriedSync | None = None) -> dict[str, float]:
        """Sync `request.version` to every engine (or take the outcome of that sync, `carried` by the train step's
        call). An engine that died since the rollout fails the sync (the others roll back): it is restarted at the
        current version and the sync runs once more."""
        r = self.recipe
        version = request.version
        try:
            metrics = publish_weights(self.trainer, self.engines, request, carried)
        except ActorCallError as e:
            if isinstance(e, TrainerRankError):
                raise
            dead = [k for k, ok in enumerate(self.engines.health(r.timeouts.health_s)) if not ok]
            if not dead:
                raise
            self.engines.recovery.recover({k: f"dead at the weight sync to version {version}: its health check "
                                              f"failed{self.engines.health_cause(k)}; the sync: {first_line(e)}"
                                           for k in dead})  # (recover keeps a reason's first line)
            metrics = publish_weights(self.trainer, self.engines, request)
        metrics["engine/restarts"] = float(self.engines.recovery.take_restarts())  # (the rollout's are in the batch)
        self.version = version
        return metrics

    def _resume(self) -> int:
        run = self.ctx
        directory = self.checkpoints.load_for_resume(self.trainer, run.resume_dir)
        truncate_step_files(run.out_dir, step_of(directory))  # again: a damaged checkpoint sends it further back
        step, version = restore_driver_state(run.data, directory)
        self._publish(self._sync_request(version, staged=False))  # engines start from the initial weights
        log(f"resumed from {directory} (the newest complete checkpoint) at step {step}")
        return step

    def _show_samples(self, step: int, batch: RolloutBatch) -> None:
        s = self.recipe.logging.samples
        if samples_due(step, s.every_n_steps, self.recipe.run.num_steps):
            self.ctx.samples.log(completion_samples(step, batch.rollouts, self.ctx.tokenizer, s.count))

    def _save(self, step: int, pending: PendingRollout | None) -> None:
        # A rollout in flight for `step` already took its prompts: resume before them, or they would be skipped.
        data_state = pending.data_state if pending is not None else self.ctx.data.state_dict()
        self.checkpoints.save(self.trainer, step, self.version, data_state)

    def _finish(self, elapsed_s: float) -> None:
        r, run = self.recipe, self.ctx
        self._save(r.run.num_steps, None)  # the final checkpoint, also with every_n_steps: 0 ("only at the end")
        self.checkpoints.wait(self.trainer)
        hf = adapter = None
        if r.trainer.lora is not None:  # the trained adapter, in the format `peft` loads (docs/lora.md)
            adapter = self.trainer.save_lora_adapter(str(run.out_dir / ADAPTER_DIR))
            log(f"final LoRA adapter (PEFT format): {adapter}")
        if r.checkpoint.export_hf_at_end:
            hf = self.trainer.export_hf_checkpoint(str(run.out_dir / "hf_final"))
            log(f"final HF checkpoint (SGLang format): {hf}")
        self.resources.release("logger")  # flushed before the summary reads metrics.jsonl
        self.resources.release("samples")
        last = published(run.checkpoint_root)
        plot_and_summarize(run.out_dir, r.logging.plot_reward_curve, run={
            "name": r.run.name, "num_steps": r.run.num_steps, "wall_time_s": round(elapsed_s, 3),
            "resumed_from": str(run.resume_dir) if run.resume_dir else None,
            "output_dir": str(run.out_dir), "checkpoint_dir": str(run.checkpoint_root),
            "last_checkpoint": str(last[-1]) if last else None, "hf_export": hf, "lora_adapter": adapter})
