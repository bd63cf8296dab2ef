"""Shared set-up of the ninth session's CPU measurements: the real `MegatronTrainer` of the quickstart (one gloo
rank, one thread, as in the trainer actor) and one captured GRPO `train_step`, from the output directory of
`benchmarks/profile_step.py` (its run's SFT checkpoint and its captures).

    PYTHONPATH=. .venv/bin/python benchmarks/profile_step.py --steps 8 --sft-steps 15 --out /tmp/ps1
    PYTHONPATH=. .venv/bin/python docs/benchmarks/2026-12-02-overhead-cpu-s9/<script>.py /tmp/ps1
"""

import os
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(20000 + os.getpid() % 20000))

import torch  # noqa: E402

torch.set_num_threads(1)
import profile_step as ps  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ps1")


def recipe_and_model():
    return ps._recipe_and_model(ps.parse_args(["--out", str(OUT)]), OUT)


def trainer_and_step():
    """(trainer, step): `step()` runs the captured GRPO train_step once."""
    from beamrl.loop.setup import trainer_setup
    from beamrl.trainer.megatron.worker import MegatronTrainer

    recipe, model = recipe_and_model()
    trainer = MegatronTrainer(trainer_setup(recipe, model), hf_checkpoint=str(OUT / "run" / "sft_checkpoint"))
    args, kwargs = pickle.loads((OUT / "capture" / "grpo_train_step.pkl").read_bytes())
    trainer.set_routing_replay(kwargs.get("replay", True))

    def step():
        trainer.train_step(args[0], args[1], temperature=kwargs.get("temperature", 1.0))

    return trainer, step
