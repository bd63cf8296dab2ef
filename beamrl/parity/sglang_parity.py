"""Reference model vs SGLang: the same token sequences scored by both, and the routes of generated continuations.

1. Random prompts (`num_sequences` x `seq_len`, seeded) go to SGLang with `logprob_start_len=0` and
   `return_routed_experts`, and each is continued for `gen_len` tokens.
2. Prompt logprobs are compared with `BeamForCausalLM.token_logprobs` on the same prompts.
3. The engine's routes (prompt + continuation, the last sampled token is never forwarded) are compared with the
   reference model's routes on the same full sequence (top-k SET agreement per token x MoE layer).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from beamrl.dtypes import RUN_DTYPES, torch_dtype
from beamrl.parity.comparison import Comparison, logprob_diffs, routing_matches, summarize



class ParityInputError(ValueError):
    """A user-fixable input problem (missing or malformed checkpoint, bad option)."""


@dataclass(frozen=True)
class ParitySettings:
    checkpoint: Path
    dtype: str = "float32"
    num_sequences: int = 8
    seq_len: int = 64
    gen_len: int = 16
    seed: int = 0
    start_timeout: float = 600.0
    call_timeout: float = 600.0
    dump_path: Path | None = None  # save the engine's raw outputs for offline analysis

    def __post_init__(self) -> None:
        if self.dtype not in RUN_DTYPES:
            raise ParityInputError(f"--dtype {self.dtype!r}; allowed: {sorted(RUN_DTYPES)}")
        for name in ("num_sequences", "seq_len", "gen_len"):
            if getattr(self, name) < (2 if name == "seq_len" else 1):
                raise ParityInputError(f"--{name.replace('_', '-')} must be >= {2 if name == 'seq_len' else 1}")


def check_checkpoint(path: Path):
    """Validate the checkpoint up front so users get a clear error, not an engine stack trace."""
    from beamrl.models.beam.checkpoint import load_checkpoint

    if not path.is_dir():
        raise ParityInputError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").exists():
        raise ParityInputError(f"{path} has no config.json: not a Beam checkpoint")
    try:
        config, state = load_checkpoint(path)
    except (ValueError, OSError, RuntimeError) as e:  # CheckpointError / BeamConfigError / safetensors errors
        raise ParityInputError(f"malformed checkpoint {path}: {e}") from None
    head = state["lm_head.weight"].float()
    return config, bool(torch.equal(head, head.bfloat16().float()))


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    """Token ids in [1, vocab) (0 is often EOS), reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (num, length), generator=g).tolist()


def reference_side(model, prompts: list[list[int]], full_seqs: list[list[int]]):
    """Reference prompt logprobs (T=1) and routes [T-1, L, k] on each full sequence minus its last token."""
    with torch.no_grad():
        ids = torch.tensor(prompts, dtype=torch.long)
        ref_lp = model.token_logprobs(ids).float().numpy()
        routes = []
        for seq in full_seqs:
            out = model.forward(torch.tensor([seq[:-1]], dtype=torch.long), return_routes=True)
            routes.append(out.routes[0].numpy())
    return [list(r) for r in ref_lp], routes


def run_sglang_parity(settings: ParitySettings, log: Callable[[str], None] = print) -> Comparison:
    """Start SGLang on the checkpoint, run both sides, and return the comparison row."""
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.protocols.rollout import GenerateRequest, SamplingParams
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.engine import SGLangEngine

    s = settings
    config, head_is_bf16 = check_checkpoint(s.checkpoint)
    if s.dtype == "float32" and not head_is_bf16:
        log("warning: SGLang's Beam stores lm_head in BF16 even in a float32 engine, and this checkpoint's lm_head "
            "is not BF16-representable: expect float32 gaps of ~1e-3 from the head alone (use a bfloat16 checkpoint)")
    if s.seq_len + s.gen_len > config.max_position_embeddings:
        raise ParityInputError(f"--seq-len + gen_len = {s.seq_len + s.gen_len} exceeds max_position_embeddings "
                               f"{config.max_position_embeddings}")
    prompts = random_prompts(config.vocab_size, s.num_sequences, s.seq_len, s.seed)
    if torch.cuda.is_available():
        engine_cfg = SGLangEngineConfig(model_path=str(s.checkpoint), dtype=s.dtype, device="cuda",
                                        mem_fraction=0.5, random_seed=s.seed,
                                        enable_fp32_lm_head=s.dtype == "float32")
    else:
        engine_cfg = SGLangEngineConfig.on_cpu(s.checkpoint, dtype=s.dtype, random_seed=s.seed,
                                                 max_total_tokens=max(2048, 4 * (s.seq_len + s.gen_len)),
                                                 enable_fp32_lm_head=s.dtype == "float32")
    log(f"starting SGLang ({engine_cfg.device}, {s.dtype}) on {s.checkpoint} (timeout {s.start_timeout:.0f} s)...")
    t0 = time.monotonic()
    engine = SGLangEngine(engine_cfg, start_timeout=s.start_timeout)
    try:
        log(f"engine up in {time.monotonic() - t0:.1f} s; scoring {s.num_sequences} x {s.seq_len} tokens and "
            f"generating {s.gen_len} more per sequence...")
        reqs = [GenerateRequest(prompt_ids=p, sampling=SamplingParams(max_new_tokens=s.gen_len, temperature=1.0,
                                                                      ignore_eos=True),
                                return_routed_experts=True) for p in prompts]
        results = engine.generate_with_prompt_logprobs(reqs, timeout=s.call_timeout)
    finally:
        engine.shutdown()
    engine_lp = [lp for _, lp in results]
    full_seqs = [p + r.output_ids for p, (r, _) in zip(prompts, results)]
    if s.dump_path is not None:
        save_engine_outputs(s.dump_path, prompts, engine_lp, full_seqs, [r.routed_experts for r, _ in results])
        log(f"engine outputs saved to {s.dump_path}")
    log("running the reference model...")
    model = BeamForCausalLM.from_pretrained(s.checkpoint, dtype=torch_dtype(s.dtype))
    ref_lp, ref_routes = reference_side(model, prompts, full_seqs)
    matches = [routing_matches(r.routed_experts, rr, config.moe_layers) for (r, _), rr in zip(results, ref_routes)]
    return summarize("reference", "sglang", s.dtype, logprob_diffs(ref_lp, engine_lp), matches)


def save_engine_outputs(path: Path, prompts, engine_lp, full_seqs, routes) -> None:
    """One .pt file: prompts, engine prompt logprobs, full sequences and engine routes (see `load_engine_outputs`)."""
    torch.save({"prompts": prompts, "engine_lp": engine_lp, "full_seqs": full_seqs,
                "routes": [torch.from_numpy(r) for r in routes]}, path)


def load_engine_outputs(path: Path) -> dict:
    data = torch.load(path, weights_only=True)
    data["routes"] = [r.numpy() for r in data["routes"]]
    return data


def main_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def routes_disagreement_detail(a: np.ndarray, b: np.ndarray, moe_layers) -> str:
    """First disagreeing (row, layer) pair, for debugging."""
    m = routing_matches(a, b, moe_layers)
    bad = np.argwhere(~m)
    if not bad.size:
        return "all routes agree"
    r, li = bad[0]
    layer = list(moe_layers)[li]
    return f"row {r} layer {layer}: {sorted(a[r, layer])} vs {sorted(b[r, layer])}"
