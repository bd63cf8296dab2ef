"""The optional supervised warm start (`sft` section): token NLL on (prompt, ground truth) pairs with its own
trainer and learning rate; its HF export becomes the policy that the RL trainer and the engines load."""

from __future__ import annotations

import os
import time

from beamrl.data.loader import PromptLoader
from beamrl.loop.groups import open_express
from beamrl.loop.log import log
from beamrl.loop.losses import SFTLoss
from beamrl.loop.rollouts import split_micro_batches
from beamrl.loop.setup import RunContext, start_trainer
from beamrl.models.beam.checkpoint import check_checkpoint
from beamrl.removal import remove_tree, undeleted_line
from beamrl.trainer.batching import micro_batch_count
from beamrl.trainer.protocol import PackedBatch


def sft_warm_start(run: RunContext) -> str:
    """Train `sft.steps` steps of `sft.batch` pairs at `sft.lr`; returns the exported HF checkpoint (reused when
    a previous attempt of this run already wrote it)."""
    r = run.recipe
    sft = r.sft
    out = run.out_dir / "sft_checkpoint"
    if out.exists():
        try:  # whole since it is renamed into place once written; headers only, seconds even when huge
            check_checkpoint(out)
        except Exception as exc:  # noqa: BLE001 - said with what to do, never trained on
            raise RuntimeError(f"SFT: {out} exists but is not a whole checkpoint ({type(exc).__name__}: {exc}); "
                               "delete it to run the SFT warm start again") from exc
        log(f"SFT: reusing {out}")
        return str(out)
    partial = out.with_name(out.name + ".partial")  # a crash mid-export leaves only this, never `out`
    errors = remove_tree(partial)
    if errors:
        raise RuntimeError(f"SFT: {undeleted_line(partial, errors)}")
    log(f"SFT warm start: {sft.steps} steps of {sft.batch} (prompt, answer) pairs at lr {sft.lr:g}, on a trainer "
        "of its own")
    trainer = start_trainer(run, run.initial_checkpoint, lr=sft.lr)
    loader = sft_loader(run.data.samples, sft.batch, r.run.seed)
    t0 = time.perf_counter()
    try:
        log(f"SFT: {open_express([trainer], None, r.placement.express_calls)}")
        for i in range(sft.steps):
            pbs, loss = sft_step_batches(loader.next_batch(sft.batch), run.tokenizer, trainer.dp_size,
                                         r.trainer.micro_batch_size)
            res = trainer.train_step(pbs, loss, replay=False)
            if i % max(1, sft.steps // 10) == 0 or i == sft.steps - 1:
                log(f"SFT step {i + 1}/{sft.steps}: nll {res.loss:.4f} ({time.perf_counter() - t0:.1f} s)")
        trainer.export_hf_checkpoint(str(partial))
    finally:
        trainer.shutdown()
    os.replace(partial, out)
    return str(out)


def sft_loader(samples, batch: int, run_seed: int) -> PromptLoader:
    """The warm start's own epochs over the prompt samples (seeded shuffle, `run.seed + 1`)."""
    return PromptLoader(list(samples), batch, shuffle=True, seed=run_seed + 1)


def sft_step_batches(samples, tokenizer, dp_size: int, micro_batch_size: int) -> tuple[list[PackedBatch], SFTLoss]:
    """One SFT step's packed micro-batches (prompt + ground truth + eos, loss on the answer and eos), cut as the RL
    step cuts its own (`trainer.micro_batch_size` samples each, a multiple of the DP size: `micro_batch_count`),
    and its loss (token mean over the whole step). Also used by benchmarks/profile_step.py."""
    eos = int(tokenizer.eos_token_id)
    seqs, masks = [], []
    for p in samples:
        answer = tokenizer.encode(str(p.ground_truth)) + [eos]
        seqs.append(list(p.prompt_ids) + answer)
        masks.append([0.0] * len(p.prompt_ids) + [1.0] * len(answer))
    shares = split_micro_batches(list(zip(seqs, masks)), micro_batch_count(len(seqs), micro_batch_size, dp_size))
    pbs = [PackedBatch.from_sequences([x for x, _ in sh], loss_masks=[m for _, m in sh]) for sh in shares]
    return pbs, SFTLoss(float(sum(pb.num_loss_tokens for pb in pbs)))
