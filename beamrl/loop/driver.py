"""`RLDriver`: runs a recipe. One step = rollout -> rewards -> (dynamic sampling) -> advantages -> old logprobs
-> train step -> weight sync (new version) -> metrics. Colocated mode alternates generation and training on
the same devices; disaggregated one-step-off mode generates step k+1 while step k trains (importance
correction against the rollout logprobs is then required by the recipe rules)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from beamrl.algorithms import ImportanceConfig, KLConfig, PolicyLossConfig, loss_normalizer, token_kl
from beamrl.loop import components, step as S
from beamrl.loop.groups import EngineGroup, TrainerGroup
from beamrl.loop.losses import PolicyLoss, SFTLoss
from beamrl.loop.ray_utils import connect_cluster_ray, init_local_ray
from beamrl.loop.rollouts import build_packed_batch, split_micro_batches
from beamrl.loop.run_state import latest_checkpoint, load_driver_state, save_driver_state
from beamrl.trainer.protocol import PackedBatch


def _log(msg: str) -> None:
    print(f"[beamrl] {msg}", flush=True)


class RLDriver:
    """Owns the actors of a run and the step loop. Use as a context manager so actors are always released."""

    def __init__(self, recipe, resume: bool = False):
        self.recipe = recipe
        self.resume = resume
        self.out_dir = Path(recipe.run.resolved_output_dir)
        self.ckpt_root = Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else self.out_dir / "checkpoints"
        self.trainer: TrainerGroup | None = None
        self.reference: TrainerGroup | None = None
        self.engines: EngineGroup | None = None
        self.rewards = None
        self.logger = None
        self.version = 0
        self._data_state_at: dict[int, dict] = {}
        self._ray_started = False
        self._ray_tmp: Path | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "RLDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release everything, each piece on its own: one failing teardown must not leak the others."""
        for name in ("engines", "trainer", "reference", "rewards", "logger"):
            obj = getattr(self, name)
            if obj is None:
                continue
            setattr(self, name, None)
            try:
                obj.shutdown() if hasattr(obj, "shutdown") else obj.close()
            except Exception as e:  # noqa: BLE001 - report and go on releasing the rest
                _log(f"warning: closing {name} failed: {type(e).__name__}: {e}")
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False
            if self._ray_tmp is not None:
                shutil.rmtree(self._ray_tmp, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ set-up
    @property
    def cpu(self) -> bool:
        return self.recipe.cluster.device == "cpu"

    # GPU shares when actors share a GPU: policy rank + reference rank + colocated engine <= 1.
    _POLICY_SHARE, _REFERENCE_SHARE, _ENGINE_SHARE = 0.6, 0.2, 0.2

    def _actor_options(self, n: int, reference: bool = False) -> list[dict]:
        # CPU: one core-slot per actor. GPU: a trainer rank per GPU; the KL reference ranks and colocated
        # engines share those GPUs. The cluster (launch/) provides the GPUs.
        if self.cpu:
            return [{"num_cpus": 1} for _ in range(n)]
        share = self._REFERENCE_SHARE if reference else self._POLICY_SHARE
        return [{"num_cpus": 1, "num_gpus": share} for _ in range(n)]

    def _engine_options(self, n: int) -> list[dict]:
        if self.cpu:
            return [{"num_cpus": 1} for _ in range(n)]
        r = self.recipe
        gpus = self._ENGINE_SHARE if r.placement.mode == "colocated" else r.rollout.engine_tp
        return [{"num_cpus": 1, "num_gpus": gpus} for _ in range(n)]

    def _check_launchable(self) -> None:
        """Layouts that `--dry-run` plans but this loop cannot launch yet fail here, by name, before any actor."""
        r = self.recipe
        if self.cpu:
            return
        if r.rollout.engine_tp > r.cluster.gpus_per_node:
            raise NotImplementedError(
                f"rollout.engine_tp={r.rollout.engine_tp} spans several nodes (cluster.gpus_per_node="
                f"{r.cluster.gpus_per_node}); beamrl does not launch multi-node SGLang engines yet (docs/rl-loop.md)")
        if r.placement.mode == "colocated" and r.rollout.engine_tp != 1:
            raise NotImplementedError(f"placement.mode=colocated with rollout.engine_tp={r.rollout.engine_tp}: "
                                      f"colocated GPU engines are launched one GPU each (engine_tp 1) for now")

    def _setup(self) -> None:
        r = self.recipe
        self.config = components.model_config(r)  # first: a missing checkpoint leaves no output directory behind
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "recipe.yaml").write_text(r.to_yaml())
        torch.manual_seed(r.run.seed)
        from beamrl.data.loader import build_prompt_loader
        from beamrl.data.prompts import load_tokenizer

        self.tokenizer = load_tokenizer(r.data.tokenizer, r.model.checkpoint)
        self.data = build_prompt_loader(r, self.tokenizer)
        vocab = getattr(self.tokenizer, "vocab_size", None) or len(self.tokenizer)
        if vocab > self.config.vocab_size:
            raise ValueError(f"data.tokenizer has {vocab} tokens but the model's vocab_size is {self.config.vocab_size}")
        self.stop_ids = tuple(sorted({int(self.tokenizer.eos_token_id)}))
        self.checkpoint = components.initial_checkpoint(r, self.config, self.out_dir)

        from beamrl.rewards import RewardManager

        self.rewards = RewardManager(r.rewards, r.reward_pool, log=_log)
        self.rewards.start()
        self.resume_dir = latest_checkpoint(self.ckpt_root) if self.resume else None
        if self.resume and self.resume_dir is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {self.ckpt_root}")
        if not self.resume and latest_checkpoint(self.ckpt_root) is not None:
            raise FileExistsError(f"{self.ckpt_root} holds checkpoints of an earlier run: continue it with --resume, or "
                                  f"start a new one with run.name=... or run.output_dir=... (nothing was deleted)")
        self._truncate_metrics(int(self.resume_dir.name.split("_")[1]) if self.resume_dir else 0)
        from beamrl.metrics import build_metrics_logger

        self.logger = build_metrics_logger(r, self.out_dir)

        n_trainer = r.trainer.num_gpus
        self._check_launchable()
        self._staged_memory = r.placement.mode == "colocated" and not self.cpu
        if self.cpu:
            # A private, short temp dir: parallel runs must not share Ray's sockets (and socket paths are short).
            self._ray_tmp = Path(tempfile.mkdtemp(prefix="beamrl-ray-", dir="/tmp"))
            n_reference = n_trainer if r.algorithm.kl.reference else 0
            init_local_ray(num_cpus=n_trainer + n_reference + r.rollout.num_engines + 2, temp_dir=self._ray_tmp)
        else:
            connect_cluster_ray()
        self._ray_started = True
        self.replay = bool(r.algorithm.routing_replay if r.algorithm.routing_replay is not None
                           else bool(self.config.moe_layers))
        self.return_routes = bool(r.rollout.return_routed_experts if r.rollout.return_routed_experts is not None
                                  else self.replay)

    def _start_trainer(self, hf_checkpoint: str, lr: float | None = None, reference: bool = False) -> TrainerGroup:
        r = self.recipe
        t0 = time.perf_counter()
        group = TrainerGroup(components.trainer_config(r, self.config, lr), hf_checkpoint, r.trainer.num_gpus,
                             r.timeouts.train_step_s, self._actor_options(r.trainer.num_gpus, reference))
        _log(f"trainer: {r.trainer.num_gpus} Megatron rank(s) ready in {time.perf_counter() - t0:.1f} s")
        return group

    def _start_engines(self, checkpoint: str) -> None:
        r = self.recipe
        t0 = time.perf_counter()
        factories = components.engine_factories(r, checkpoint, self.return_routes)
        self.engines = EngineGroup(factories, r.timeouts.generate_s, self._engine_options(len(factories)))
        _log(f"rollout: {len(factories)} {r.rollout.engine} engine(s) ready in {time.perf_counter() - t0:.1f} s")

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> Path:
        r = self.recipe
        self._setup()
        start_step = 0
        resume_dir = self.resume_dir
        policy_ckpt = self.checkpoint
        if resume_dir is None and r.sft is not None:
            policy_ckpt = self._sft_warm_start()
        self.trainer = self._start_trainer(policy_ckpt)
        if r.algorithm.kl.reference:  # the reference is the policy's starting point (after SFT, also on resume)
            sft_ckpt = self.out_dir / "sft_checkpoint"
            ref_ckpt = str(sft_ckpt) if r.sft is not None and (sft_ckpt / "config.json").exists() else policy_ckpt
            self.reference = self._start_trainer(ref_ckpt, reference=True)
        self._start_engines(policy_ckpt)
        if resume_dir is not None:
            self.trainer.load_checkpoint(str(resume_dir / "trainer"))
            state = load_driver_state(resume_dir)
            self.data.load_state_dict(state["data"])
            start_step, self.version = state["step"], state["weight_version"]
            self._sync(self.version)  # engines start from the initial weights: bring them to the checkpoint
            _log(f"resumed from {resume_dir} at step {start_step}")
        pending = None
        for step in range(start_step, r.run.num_steps):
            t_step = time.perf_counter()
            metrics: dict[str, float] = {}
            if pending is None:
                pending = self._start_rollout(step)
            rollouts, rm = self._finish_rollout(pending, step)
            metrics.update(rm)
            pending = None
            if r.placement.off_policy_steps == 1 and step + 1 < r.run.num_steps:
                pending = self._start_rollout(step + 1)  # overlaps the train step below
            staged = self._staged_memory
            if staged:  # colocated GPU: the engines give their memory to training (anchors' staged order)
                self.engines.call_all("release_memory", r.timeouts.sync_s, None)
            metrics.update(self._train(rollouts))
            if pending is not None:
                # Engines must be idle to update: collect the overlapped rollout first (it used version k).
                pending = ("done", self._finish_rollout(pending, step + 1))
            if staged:
                self.engines.call_all("resume_memory", r.timeouts.sync_s, ["weights"])
            metrics.update(self._sync(step + 1))
            if staged:  # KV cache last, to keep the peak low during the weight update
                self.engines.call_all("resume_memory", r.timeouts.sync_s, ["kv_cache", "cuda_graph"])
            metrics["time/step_s"] = time.perf_counter() - t_step
            self.logger.log(step, metrics)
            if r.checkpoint.every_n_steps and (step + 1) % r.checkpoint.every_n_steps == 0 and step + 1 < r.run.num_steps:
                self._save(step + 1)
        self._finish()
        return self.out_dir

    # ------------------------------------------------------------------------------------------ pieces
    def _start_rollout(self, step: int):
        # The data position before this step's prompts: a checkpoint taken while this rollout is in flight
        # must resume *before* it, or its prompts would be skipped.
        self._data_state_at[step] = self.data.state_dict()
        prompts = self.data.next_batch(self.recipe.rollout.prompts_per_step)
        groups = S.make_requests(prompts, self.recipe, step, 0, self.stop_ids, self.return_routes)
        t0 = time.perf_counter()
        return ("running", prompts, self.engines.generate_async(groups, self.recipe.timeouts.generate_s), t0, step)

    def _finish_rollout(self, pending, step: int):
        if pending[0] == "done":
            return pending[1]
        _, prompts, handle, t0, _ = pending
        r = self.recipe
        results = self.engines.collect(handle)
        rollouts, n_aborted = S.drop_aborted(S.to_rollouts(prompts, results, 0))
        gen_s = time.perf_counter() - t0
        metrics = S.score(rollouts, self.tokenizer, self.rewards)
        metrics["rollout/aborted_groups"] = float(n_aborted)
        metrics["reward/mean"] = sum(x.raw_reward for x in rollouts) / len(rollouts)
        metrics.update(S.rollout_metrics(rollouts, r.rollout.max_new_tokens))
        if r.algorithm.dynamic_sampling.enabled:
            rollouts, ds_metrics = self._dynamic_sampling(rollouts, prompts, step)
            metrics.update(ds_metrics)
        S.shape_and_advantages(rollouts, r)
        n_tokens = sum(x.response_len for x in rollouts)
        metrics.update({"time/rollout_s": gen_s, "throughput/rollout_tokens_per_s": n_tokens / max(gen_s, 1e-9),
                        "rollout/weight_version": float(min(x.result.weight_version for x in rollouts))})
        return rollouts, metrics

    def _dynamic_sampling(self, rollouts, prompts, step):
        """Keep groups with informative raw rewards; over-sample more prompts for up to N extra rounds."""
        r = self.recipe
        target = r.rollout.prompts_per_step
        kept, res = S.keep_informative_groups(rollouts, target, 0)
        metrics = dict(res.metrics)
        next_group = len(prompts)
        for round_ in range(1, r.algorithm.dynamic_sampling.max_oversample_rounds + 1):
            if res.num_needed == 0:
                break
            more = self.data.next_batch(max(1, res.suggested_num_prompts))
            groups = S.make_requests(more, r, step, round_, self.stop_ids, self.return_routes)
            extra, _ = S.drop_aborted(S.to_rollouts(more, self.engines.generate(groups, r.timeouts.generate_s),
                                                    next_group))
            next_group += len(more)
            S.score(extra, self.tokenizer, self.rewards)
            new, res = S.keep_informative_groups(extra, target, len({x.group for x in kept}))
            kept += new
        metrics["dynamic_sampling/groups_kept"] = float(len({x.group for x in kept}))
        if not kept:  # nothing informative at all: train on the original batch (advantages are all zero)
            kept = rollouts
        return kept, metrics

    def _micro_batches(self, rollouts) -> list[PackedBatch]:
        """Micro-batches of about `micro_batch_size` samples, their number a multiple of the DP size (each DP
        rank trains on an equal share)."""
        t = self.recipe.trainer
        dp = self.trainer.dp_size
        if len(rollouts) < dp:
            raise ValueError(f"{len(rollouts)} samples left after filtering cannot feed {dp} data-parallel ranks")
        n_micro = max(1, len(rollouts) // t.micro_batch_size)
        n_micro = max(dp, n_micro - n_micro % dp)
        return [build_packed_batch(chunk, self.config, self.replay) for chunk in split_micro_batches(rollouts, n_micro)]

    def _train(self, rollouts) -> dict[str, float]:
        """Train on one rollout batch in `samples / trainer.global_batch_size` optimizer steps.

        With one step, pi_old is the policy of the train forward itself (no extra pass). With several, the
        old logprobs of every sample are computed first, before the first update."""
        r = self.recipe
        a = r.algorithm
        t0 = time.perf_counter()
        n_steps = max(1, len(rollouts) // r.trainer.global_batch_size)
        chunks = split_micro_batches(rollouts, n_steps)
        steps = [self._micro_batches(chunk) for chunk in chunks]
        kls = []
        for micro in steps:
            for mb in micro:
                if n_steps > 1 or self.reference is not None:
                    cur = self.trainer.compute_logprobs(mb, r.rollout.temperature, self.replay)
                    mb.fields["old_logprobs"] = cur.logprobs.detach().float()
                if self.reference is not None:
                    ref = self.reference.compute_logprobs(mb, r.rollout.temperature, self.replay)
                    mb.fields["ref_logprobs"] = ref.logprobs.detach().float()
                    kl = token_kl(mb.fields["old_logprobs"], mb.fields["ref_logprobs"],
                                  KLConfig(coef=a.kl.coef, estimator=a.kl.estimator))
                    kls.append((kl * mb.loss_mask).sum().item())
        logprob_s = time.perf_counter() - t0
        imp = None
        if a.importance.mode != "none":
            knobs = {k: getattr(a.importance, k) for k in ("cap", "lo", "hi") if getattr(a.importance, k) is not None}
            imp = ImportanceConfig(method=a.importance.mode, level=a.importance.level, **knobs)
        cfg = PolicyLossConfig(eps_low=a.eps_clip_low, eps_high=a.eps_clip_high, aggregation=a.loss_agg,
                               importance=imp, kl=KLConfig(coef=a.kl.coef, estimator=a.kl.estimator))
        t1 = time.perf_counter()
        sums: dict[str, float] = {}
        all_toks = 0.0
        for micro in steps:
            toks = float(sum(mb.num_loss_tokens for mb in micro))
            all_toks += toks
            all_mask = torch.cat([mb.loss_mask for mb in micro])
            all_seq = torch.cat([torch.repeat_interleave(torch.arange(mb.num_sequences) + 10**6 * i,
                                                         mb.cu_seqlens[1:] - mb.cu_seqlens[:-1])
                                 for i, mb in enumerate(micro)])
            normalizer = loss_normalizer(all_mask > 0, all_seq, a.loss_agg)
            result = self.trainer.train_step(micro, PolicyLoss(a.loss, cfg, normalizer, toks), self.replay,
                                             temperature=r.rollout.temperature)
            for k, v in result.as_dict().items():
                sums[k] = sums.get(k, 0.0) + float(v)
        train_s = time.perf_counter() - t1
        out = {f"train/{k}": v / len(steps) for k, v in sums.items()}  # mean over this rollout's steps
        out["train/optimizer_steps"] = float(len(steps))
        for key in ("train_rollout_logprob_abs_diff", "entropy"):
            if f"train/{key}" in out:
                out[key] = out.pop(f"train/{key}")
        n_tokens = float(sum(mb.num_tokens for micro in steps for mb in micro))
        out.update({"time/logprob_s": logprob_s, "time/train_s": train_s,
                    "throughput/train_tokens_per_s": n_tokens / max(train_s, 1e-9)})
        if kls:
            out["kl"] = sum(kls) / max(all_toks, 1.0)
        return out

    def _sync(self, version: int) -> dict[str, float]:
        r = self.recipe
        report = self.trainer.sync_weights(self.engines, version, r.sync.transport, r.sync.bucket_mb << 20,
                                           r.timeouts.sync_s, progress=False)
        self.version = version
        versions = self.engines.versions()
        if any(v != version for v in versions):
            raise RuntimeError(f"weight sync to version {version} finished but engines report versions {versions}")
        out = {"time/sync_s": report["seconds"], "sync/bytes": float(report["bytes"]), "sync/gbps": report["gbps"],
               "sync/version": float(version)}
        if r.sync.verify:
            out["sync/verify_max_abs_logprob_diff"] = self._verify_sync()
        return out

    def _verify_sync(self) -> float:
        """Engine prompt logprobs vs trainer logprobs on fixed probe sequences, free routing on both sides."""
        eos = int(self.tokenizer.eos_token_id)
        probe = [list(p.prompt_ids) + self.tokenizer.encode(str(p.ground_truth)) + [eos] for p in self.data.samples[:2]]
        scores = self.engines.score(probe, self.recipe.timeouts.generate_s)
        batch = PackedBatch.from_sequences(probe)
        tr = self.trainer.compute_logprobs(batch, 1.0, replay=False).logprobs
        worst = 0.0
        for eng in scores.values():  # every engine, so one bad replica cannot hide behind another
            for i, (a, b) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())):
                t_lp = tr[a + 1:b]
                e_lp = torch.tensor(eng[i][-len(t_lp):], dtype=torch.float32)
                worst = max(worst, float((t_lp - e_lp).abs().max()))
        tol = 1e-3 if self.recipe.model.dtype == "float32" else 0.5
        if worst > tol:
            raise RuntimeError(f"post-sync verification failed: engine vs trainer max |delta logprob| = {worst:.3g} "
                               f"> {tol} (engines now serve version {self.version}; restart them)")
        return worst

    def _save(self, step: int) -> None:
        d = self.ckpt_root / f"step_{step}"
        t0 = time.perf_counter()
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        self.trainer.save_checkpoint(str(d / "trainer"))
        data_state = self._data_state_at.get(step, self.data.state_dict())
        save_driver_state(d, step, self.version, data_state)
        self._data_state_at = {k: v for k, v in self._data_state_at.items() if k >= step}
        kept = sorted(self.ckpt_root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        for old in kept[: -self.recipe.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        _log(f"checkpoint step {step} saved to {d} in {time.perf_counter() - t0:.1f} s")

    def _finish(self) -> None:
        r = self.recipe
        if r.checkpoint.every_n_steps:
            self._save(r.run.num_steps)
        if r.checkpoint.export_hf_at_end:
            path = self.trainer.export_hf_checkpoint(str(self.out_dir / "hf_final"), r.sync.bucket_mb << 20)
            _log(f"final HF checkpoint (SGLang format): {path}")
        self.logger.close()
        self.logger = None
        metrics_path = self.out_dir / "metrics.jsonl"
        if r.logging.plot_reward_curve and metrics_path.exists():
            from beamrl.metrics.plot import plot_reward_curve

            plot_reward_curve(metrics_path, self.out_dir / "reward_curve.png")
        self._write_summary(metrics_path)

    def _truncate_metrics(self, first_step: int) -> None:
        """Keep metrics.jsonl lines of steps before `first_step` (a fresh run starts empty; a resumed run drops
        the steps after its checkpoint, which it recomputes)."""
        path = self.out_dir / "metrics.jsonl"
        if not path.exists():
            return
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < first_step]
        path.write_text("".join(ln + "\n" for ln in keep))

    def _write_summary(self, metrics_path: Path) -> None:
        """summary.json: mean reward of the first and last 20% of steps (the quickstart's learning check)."""
        if not metrics_path.exists():
            return
        rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
        rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
        if not rewards:
            return
        k = max(1, len(rewards) // 5)
        summary = {"steps": len(rewards), "reward_first_20pct": sum(rewards[:k]) / k,
                   "reward_last_20pct": sum(rewards[-k:]) / k}
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        _log(f"mean reward: first 20% of steps {summary['reward_first_20pct']:.3f} -> last 20% "
             f"{summary['reward_last_20pct']:.3f} ({self.out_dir / 'summary.json'})")

    def _sft_warm_start(self) -> str:
        """Supervised warm start on (prompt, ground truth) with its own trainer and LR; returns the HF checkpoint
        of the result, which the RL trainer and the engines then load."""
        r = self.recipe
        out = self.out_dir / "sft_checkpoint"
        if (out / "config.json").exists():
            _log(f"SFT: reusing {out}")
            return str(out)
        sft = r.sft
        trainer = self._start_trainer(self.checkpoint, lr=sft.lr)
        from beamrl.data.loader import PromptLoader

        loader = PromptLoader(list(self.data.samples), sft.batch, shuffle=True, seed=r.run.seed + 1)
        eos = int(self.tokenizer.eos_token_id)
        t0 = time.perf_counter()
        try:
            for i in range(sft.steps):
                batch = loader.next_batch(sft.batch)
                seqs, masks = [], []
                for p in batch:
                    answer = self.tokenizer.encode(str(p.ground_truth)) + [eos]
                    seqs.append(list(p.prompt_ids) + answer)
                    masks.append([0.0] * len(p.prompt_ids) + [1.0] * len(answer))
                shares = split_micro_batches(list(zip(seqs, masks)), trainer.dp_size)
                pbs = [PackedBatch.from_sequences([x for x, _ in sh], loss_masks=[m for _, m in sh]) for sh in shares]
                total = float(sum(pb.num_loss_tokens for pb in pbs))
                res = trainer.train_step(pbs, SFTLoss(total), replay=False)
                if i % max(1, sft.steps // 10) == 0 or i == sft.steps - 1:
                    _log(f"SFT step {i + 1}/{sft.steps}: nll {res.loss:.4f} ({time.perf_counter() - t0:.1f} s)")
            trainer.export_hf_checkpoint(str(out), r.sync.bucket_mb << 20)
        finally:
            trainer.shutdown()
        return str(out)
