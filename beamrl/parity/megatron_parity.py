"""Megatron trainer vs reference model (and SGLang): per-token logprobs and routes on the same sequences.

`beamrl parity --trainer megatron --tp N [--sp] --ep N --pp N [--vpp N]` launches a real multi-process Megatron
run (`beamrl.trainer.megatron.launch`; gloo on CPU, NCCL on GPU) that loads the checkpoint through the HF
mapping into that layout and scores the same random prompts as the SGLang parity run with
`MegatronTrainer.compute_logprobs` (T = 1) in routing-record mode. The rows it adds have the shape of the
existing ones: `{"a": "megatron", "b": "reference" | "sglang", ...}`.

Alignment: the trainer's logprob of token t (t >= 1) is `log p(tok_t | tok_<t)`, exactly the reference's
`token_logprobs[t-1]` and SGLang's prompt logprob of token t; routes of prompt token t are row t of all three.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from beamrl.parity.comparison import Comparison, logprob_diffs, routing_matches, summarize
from beamrl.dtypes import RUN_DTYPES, torch_dtype
from beamrl.parity.sglang_parity import ParityInputError, check_checkpoint, random_prompts


@dataclass(frozen=True)
class MegatronLayout:
    """The Megatron layout of a parity run; the world size is the smallest that fits it."""

    tp: int = 1
    sp: bool = False
    ep: int = 1
    pp: int = 1
    vpp: int | None = None

    @property
    def world_size(self) -> int:
        return math.lcm(self.tp * self.pp, self.ep * self.pp)

    def parallel_config(self):
        from pydantic import ValidationError

        from beamrl.trainer.megatron.config import ParallelConfig

        try:
            return ParallelConfig(tp=self.tp, sp=self.sp, ep=self.ep, pp=self.pp, vpp=self.vpp)
        except ValidationError as e:
            raise ParityInputError(str(e.errors()[0]["msg"])) from None

    def describe(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else ""), f"ep{self.ep}", f"pp{self.pp}"]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        return "x".join(parts) + f" ({self.world_size} proc)"


def score_rank(checkpoint: str, layout: dict, dtype: str, prompts: list[list[int]]):
    """One rank of the Megatron side: load the checkpoint into the layout and score `prompts`. Returns
    (per-sequence logprobs of tokens 1.., per-sequence routes [T, L, k]) on global rank 0, None elsewhere."""
    import torch.distributed as dist

    from beamrl.models.beam.config import BeamConfig
    from beamrl.trainer.megatron.config import TrainerConfig
    from beamrl.trainer.megatron.worker import MegatronTrainer, TrainerSetup
    from beamrl.trainer.protocol import PackedBatch

    config = BeamConfig.from_json_file(checkpoint)
    megatron_layout = MegatronLayout(**layout)
    parallel, world = megatron_layout.parallel_config(), megatron_layout.world_size
    # Scoring only: the learning rate and batch sizes are never used.
    trainer_config = TrainerConfig(**parallel.to_dict(), num_gpus=world, global_batch_size=parallel.dp_size(world),
                                   lr=1e-6, distributed_optimizer=False)
    trainer = MegatronTrainer(TrainerSetup(model=config, trainer=trainer_config, dtype=dtype), hf_checkpoint=checkpoint)
    batch = PackedBatch.from_sequences(prompts)
    trainer.set_routing_record(True)
    out = trainer.compute_logprobs(batch, temperature=1.0, return_entropy=False)
    trainer.shutdown()
    if dist.get_rank() != 0:
        return None
    cu = batch.cu_seqlens.tolist()
    lps = [out.logprobs[a + 1:b].tolist() for a, b in zip(cu[:-1], cu[1:])]
    routes = [out.routes[a:b].numpy() for a, b in zip(cu[:-1], cu[1:])]
    return lps, routes


def megatron_side(checkpoint: Path, layout: MegatronLayout, dtype: str, prompts: list[list[int]],
                  timeout_s: float):
    """Run `score_rank` on `layout.world_size` processes; returns rank 0's result."""
    from beamrl.trainer.megatron.launch import launch

    layout.parallel_config()  # validate before spawning
    return launch(score_rank, layout.world_size, (str(checkpoint), asdict(layout), dtype, prompts),
                  timeout_s=timeout_s)[0]


def reference_prompt_side(checkpoint: Path, dtype: str, prompts: list[list[int]]):
    """Reference logprobs of tokens 1.. and routes [T, L, k] of every prompt."""
    from beamrl.models.beam.model import BeamForCausalLM

    model = BeamForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype(dtype))
    with torch.no_grad():
        ids = torch.tensor(prompts, dtype=torch.long)
        lp = model.token_logprobs(ids).float().numpy()
        routes = model.forward(ids, return_routes=True).routes.numpy()
    return [list(r) for r in lp], [routes[i] for i in range(len(prompts))]


def run_megatron_parity(checkpoint: Path, layout: MegatronLayout, dtype: str = "float32", num_sequences: int = 8,
                        seq_len: int = 64, seed: int = 0, timeout_s: float = 600.0,
                        engine_outputs: dict | None = None,
                        log: Callable[[str], None] = print) -> list[Comparison]:
    """Megatron vs the reference (and vs SGLang when `engine_outputs` from `sglang_parity.save_engine_outputs`
    for the same prompts are given). Returns the comparison rows."""
    if dtype not in RUN_DTYPES:
        raise ParityInputError(f"--dtype {dtype!r}; allowed: {sorted(RUN_DTYPES)}")
    from beamrl.models.beam.config import BeamConfig

    from beamrl.config import ConfigError

    check_checkpoint(checkpoint)
    config = BeamConfig.from_json_file(checkpoint)
    try:  # refuse a layout the model cannot take before spawning anything
        layout.parallel_config().check_model(config)
    except ConfigError as e:
        raise ParityInputError(f"--trainer megatron layout {layout.describe()}: {e}") from None
    prompts = random_prompts(config.vocab_size, num_sequences, seq_len, seed)
    log(f"Megatron {layout.describe()} scoring {num_sequences} x {seq_len} tokens in {dtype}...")
    meg_lp, meg_routes = megatron_side(checkpoint, layout, dtype, prompts, timeout_s)
    log("running the reference model...")
    ref_lp, ref_routes = reference_prompt_side(checkpoint, dtype, prompts)
    rows = [summarize("megatron", "reference", dtype, logprob_diffs(meg_lp, ref_lp),
                      [routing_matches(m, r, config.moe_layers) for m, r in zip(meg_routes, ref_routes)])]
    if engine_outputs is not None:
        if engine_outputs["prompts"] != prompts:
            raise ParityInputError("the SGLang outputs were produced for other prompts (seed / sizes differ)")
        eng_routes = [np.asarray(r)[:seq_len] for r in engine_outputs["routes"]]
        rows.append(summarize("megatron", "sglang", dtype, logprob_diffs(meg_lp, engine_outputs["engine_lp"]),
                              [routing_matches(m, e, config.moe_layers) for m, e in zip(meg_routes, eng_routes)]))
    return rows


def run_with_sglang(settings, layout: MegatronLayout, log: Callable[[str], None] = print) -> list[Comparison]:
    """The SGLang parity run (reference vs sglang row) followed by the Megatron rows on the same prompts."""
    from beamrl.parity.sglang_parity import load_engine_outputs, run_sglang_parity

    with tempfile.TemporaryDirectory(prefix="beamrl-parity-") as tmp:
        dump = settings.dump_path or Path(tmp) / "engine.pt"
        settings = type(settings)(**{**asdict(settings), "dump_path": dump})
        sglang_row = run_sglang_parity(settings, log=log)
        engine_outputs = load_engine_outputs(dump)
    rows = run_megatron_parity(settings.checkpoint, layout, settings.dtype, settings.num_sequences, settings.seq_len,
                               settings.seed, settings.call_timeout, engine_outputs, log)
    return [sglang_row] + rows
