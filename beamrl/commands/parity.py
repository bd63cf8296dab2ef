"""`beamrl parity`: compare SGLang's logprobs and routes with the reference model on a checkpoint (docs/parity.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "parity"
HELP = "Score the same tokens in SGLang and the reference Beam model; report logprob gaps and routing agreement."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path, help="Beam checkpoint directory (SGLang format)")
    parser.add_argument("--engine", default="sglang", choices=["sglang"], help="engine to compare (default sglang)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of both sides")
    parser.add_argument("--json", type=Path, default=None, help='write {"comparisons": [...]} to this file')
    parser.add_argument("--num-sequences", type=int, default=8, help="random prompts to score (default 8)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--gen-len", type=int, default=16, help="generated tokens per prompt for routes (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts and the engine (default 0)")
    parser.add_argument("--dump", type=Path, default=None,
                        help="also save the engine's raw outputs (prompts, logprobs, routes) to this .pt file")
    parser.add_argument("--timeout", type=float, default=600.0, help="engine start / call timeout in s (default 600)")


def run(args: argparse.Namespace) -> int:
    from beamrl.parity.comparison import format_table, write_json
    from beamrl.parity.sglang_parity import ParityInputError, ParitySettings, main_log, run_sglang_parity
    from beamrl.rollout.protocol import EngineError

    try:
        settings = ParitySettings(checkpoint=args.checkpoint, dtype=args.dtype, num_sequences=args.num_sequences,
                                  seq_len=args.seq_len, gen_len=args.gen_len, seed=args.seed,
                                  start_timeout=args.timeout, call_timeout=args.timeout,
                                  dump_path=args.dump)
        row = run_sglang_parity(settings, log=main_log)
    except ParityInputError as e:
        print(f"beamrl parity: error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:
        print(f"beamrl parity: engine error: {e}", file=sys.stderr)
        return 1
    print(format_table([row]))
    if args.json is not None:
        write_json([row], args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
